"""Record the collectives your own code issues: ``with nbdist.bench.trace() as tr: ...``.

It uses torch's profiler, which sees every collective whatever issued it -- your calls, DDP's
reducer (C++, so wrapping ``torch.distributed`` in Python would miss it), FSDP's all_gathers and
reduce_scatters. Two kinds of profiler events are paired, in order:

* the *call* (``c10d::allreduce_``, ``c10d::_allgather_base_``...), on the thread that issued it,
  which names the op and the buffers (shapes and dtypes);
* the *execution* -- ``gloo:all_reduce`` on gloo's worker thread, or the NCCL kernel on the GPU --
  which gives when the data really moved and for how long.

A backend without execution events (a pure-Python one) gives the calls' own times. Nothing about
how your code runs changes (the profiler records; it does not alter the calls), but the profiler
costs a little time per op while it is on (see docs/benchmarks.md for the measured overhead).

A :class:`Trace` is plain data: return it from the ranks with ``g.run`` and
``Trace.merge(results)`` in the notebook for one timeline of every rank.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from ..report.table import Column, unit_of
from .records import Table

# profiler dtype names (C++ type names) -> (torch name, bytes per element)
_DTYPES = {"float": ("float32", 4), "double": ("float64", 8), "c10::Half": ("float16", 2),
           "c10::BFloat16": ("bfloat16", 2), "signed char": ("int8", 1),
           "unsigned char": ("uint8", 1), "short int": ("int16", 2), "int": ("int32", 4),
           "long int": ("int64", 8), "bool": ("bool", 1), "c10::complex<float>": ("complex64", 8),
           "c10::complex<double>": ("complex128", 16), "short unsigned int": ("uint16", 2),
           "unsigned int": ("uint32", 4), "long unsigned int": ("uint64", 8),
           "c10::Float8_e4m3fn": ("float8_e4m3fn", 1), "c10::Float8_e5m2": ("float8_e5m2", 1)}
_CALLS = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
          "allgather_": "all_gather", "_allgather_base_": "all_gather",
          "allgather_coalesced_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
          "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
          "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
          "reduce_": "reduce", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
          "barrier": "barrier", "monitored_barrier_": "barrier", "send": "send", "recv_": "recv",
          "recv_any_source_": "recv", "gather_": "gather", "scatter_": "scatter"}
_EXEC_RE = re.compile(r"^(gloo|nccl|ucc|mpi|xccl):\s*([A-Za-z_]+)")


def _nbytes(shapes, dtypes) -> Optional[int]:
    """Largest buffer among an event's inputs (nccl-tests' size), or None if unknown."""
    best = None
    for shape, dtype in zip(shapes or [], dtypes or []):
        if shape and dtype in _DTYPES:
            numel = 1
            for d in shape:
                numel *= d
            best = max(best or 0, numel * _DTYPES[dtype][1])
    return best


def _dtype(shapes, dtypes) -> Optional[str]:
    """torch name of the first tensor's dtype among an event's inputs."""
    return next((_DTYPES[d][0] for s, d in zip(shapes or [], dtypes or []) if s and d in _DTYPES),
                None)


class _Ev:
    """A profiler event reduced to what the pairing needs (keeps the pairing testable)."""

    __slots__ = ("name", "start_ns", "duration_ns", "nbytes", "dtype")

    def __init__(self, name: str, start_ns: int, duration_ns: int, nbytes: Optional[int] = None,
                 dtype: Optional[str] = None):
        self.name, self.start_ns, self.duration_ns = name, start_ns, duration_ns
        self.nbytes, self.dtype = nbytes, dtype


def pair(calls: List[_Ev], execs: List[_Ev], rank: int) -> List[Dict[str, Any]]:
    """Match each call with the first later execution not yet taken (the backends run a
    process group's work in the order it was issued); return one event dict per collective."""
    calls = sorted(calls, key=lambda e: e.start_ns)
    execs = sorted(execs, key=lambda e: e.start_ns)
    out, j = [], 0

    def event(op, call, run):
        sizes = [e.nbytes for e in (call, run) if e is not None and e.nbytes is not None]
        dtype = next((e.dtype for e in (call, run) if e is not None and e.dtype), None)
        if op == "barrier":  # a barrier moves a token, not data
            sizes, dtype = [], None
        return {"rank": rank, "op": op, "bytes": max(sizes) if sizes else None, "dtype": dtype,
                "start": run.start_ns / 1e9, "duration": run.duration_ns / 1e9,
                "issued": (call or run).start_ns / 1e9}

    for call in calls:
        while j < len(execs) and execs[j].start_ns < call.start_ns:
            out.append(event(_exec_op(execs[j].name), None, execs[j]))  # issued before the trace
            j += 1
        op = _CALLS.get(call.name[len("c10d::"):], call.name[len("c10d::"):].strip("_"))
        if j < len(execs):
            out.append(event(op, call, execs[j]))
            j += 1
        else:
            out.append(event(op, call, call))
    out.extend(event(_exec_op(e.name), None, e) for e in execs[j:])
    return out


def _exec_op(name: str) -> str:
    m = _EXEC_RE.match(name)
    op = m.group(2).strip("_") if m else name
    return {"allreduce": "all_reduce", "allgather": "all_gather", "all_gather_base": "all_gather",
            "reduce_scatter_base": "reduce_scatter"}.get(op, op)


def _collect(prof, rank: int) -> List[Dict[str, Any]]:
    calls, execs, kernels = [], [], []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        if name.startswith("c10d::") or _EXEC_RE.match(name):
            shapes, dtypes = e.shapes(), e.dtypes()
            ev = _Ev(name, e.start_ns(), e.duration_ns(), _nbytes(shapes, dtypes),
                     _dtype(shapes, dtypes))
            (calls if name.startswith("c10d::") else execs).append(ev)
        elif "nccl" in name.lower() and str(e.device_type()).endswith("CUDA"):
            kernels.append(_Ev(name, e.start_ns(), e.duration_ns()))
    return pair(calls, kernels or execs, rank)


_SHARE = ("per rank: calls, time; size: per call; time: from a rank's call of the op to its end, "
          "so it includes waiting for the other ranks to call it too; share: the op's time over "
          "the traced block's (collectives that overlap compute count in full, so shares may add "
          "up past 100%)")


class Summary(Table):
    """Per-op totals of a :class:`Trace` (see :meth:`Trace.summary`); shown as a table with
    ``size`` (bytes per call, in the unit of the largest op's calls, so two summaries of one
    step read alike), ``time`` and ``mean`` in one unit (the longest's) and ``share (%)``,
    which the note under the table defines."""

    def _column(self, key: str) -> Column:
        """The field ``key`` as shown; ``share`` (a fraction) in percent."""
        if key == "share":
            return Column(key, "share", "fraction", decimals=1)
        if key == "bytes":
            sizes = [r["bytes"] for r in self if r.get("bytes")]
            return Column(key, "size", "bytes", unit=unit_of("bytes", [max(sizes)]) if sizes
                          else None)
        if key in ("time_s", "mean_s"):  # both in the unit of the longest: ms next to µs misreads
            times = [r[k] for r in self for k in ("time_s", "mean_s") if r.get(k)]
            return Column(key, key[:-2], "time", unit=unit_of("time", [max(times)]) if times
                          else None)
        return super()._column(key)

    def _notes(self) -> List[str]:
        return [_SHARE] if self else []


class Trace:
    """Collectives recorded by :func:`trace`, on one rank or (after :meth:`merge`) several.

    ``events`` is a list of dicts: ``rank``, ``op``, ``bytes`` (largest buffer), ``dtype``,
    ``start`` and ``issued`` (seconds since the epoch: when it ran, when it was called),
    ``duration`` (seconds). ``spans`` maps each rank to the (begin, end) of its traced block.
    """

    def __init__(self, events: Iterable[Dict[str, Any]] = (),
                 spans: Optional[Dict[int, Tuple[float, float]]] = None):
        self.events: List[Dict[str, Any]] = list(events)
        self.spans: Dict[int, Tuple[float, float]] = dict(spans or {})

    @classmethod
    def merge(cls, traces: Iterable["Trace"]) -> "Trace":
        """One trace with the events of several (e.g. ``Trace.merge(g.run(step))``)."""
        out = cls()
        for tr in traces:
            if not isinstance(tr, Trace):
                raise TypeError(f"Trace.merge() takes Trace objects (what trace() yields on the "
                                f"ranks), got {type(tr).__name__}")
            out.events.extend(tr.events)
            out.spans.update(tr.spans)
        out.events.sort(key=lambda e: (e["start"], e["rank"]))
        return out

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return iter(self.events)

    def __repr__(self) -> str:
        return (f"<nbdist.bench.Trace: {len(self.events)} collectives on rank"
                f"{'s' if len(self.spans) != 1 else ''} {sorted(self.spans)}>")

    def to_records(self) -> Table:
        """The events as a :class:`~nbdist.bench.Table` (``to_pandas()``, ``to_csv()``...)."""
        return Table(dict(e) for e in self.events)

    def summary(self) -> Summary:
        """Per op: ``calls`` and ``time_s`` per rank (averaged over ranks), ``bytes`` per call,
        ``mean_s`` per call, and ``share``: time in the op over the traced time. Collectives
        that overlap compute (DDP's) or each other count in full, so shares may add up past 1."""
        ranks = max(1, len(self.spans) or len({e["rank"] for e in self.events}))
        traced = sum(end - begin for begin, end in self.spans.values()) / ranks
        rows: Dict[str, Dict[str, Any]] = {}
        for e in self.events:
            row = rows.setdefault(e["op"], {"op": e["op"], "calls": 0, "nbytes": None,
                                            "time": 0.0})
            row["calls"] += 1
            if e["bytes"] is not None:
                row["nbytes"] = (row["nbytes"] or 0) + e["bytes"]
            row["time"] += e["duration"]
        out = Summary()
        for row in sorted(rows.values(), key=lambda r: -r["time"]):
            per_rank = row["time"] / ranks
            out.append({"op": row["op"], "calls": row["calls"] / ranks,
                        "bytes": None if row["nbytes"] is None else row["nbytes"] / row["calls"],
                        "time_s": per_rank,
                        "mean_s": row["time"] / row["calls"],
                        "share": per_rank / traced if traced > 0 else None})
        return out

    def plot(self, ax=None):
        """A per-rank timeline of the collectives (matplotlib); return the Axes."""
        from ..ui.plots.collectives import plot_timeline

        return plot_timeline(self, ax=ax)


@contextlib.contextmanager
def trace(shapes: bool = True, cuda: Optional[bool] = None,
          quiet: bool = True) -> Iterator[Trace]:
    """Record every collective issued inside the block; yields a :class:`Trace`, filled on exit.

    Use it on the ranks (in ``%%dist`` or a function given to ``g.run``).

    Args:
        shapes: record tensor shapes, which give each collective's ``bytes`` and ``dtype``.
            ``False`` roughly halves the profiler's cost per op; ``bytes``/``dtype`` are then None.
        cuda: also record GPU kernels, so NCCL times are the kernels' (default: when CUDA is
            initialised in this process).
        quiet: set ``KINETO_LOG_LEVEL`` (unless already set) to keep the profiler's start/stop
            lines out of the output; it takes effect before the first profile in a process.
    """
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    if quiet:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    if cuda is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    tr = Trace()
    prof = profile(activities=activities, record_shapes=shapes)
    begin = time.time()
    with prof:
        try:
            yield tr
        finally:
            end = time.time()
    tr.spans[rank] = (begin, end)
    tr.events.extend(_collect(prof, rank))
