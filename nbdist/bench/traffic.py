"""What each mesh dimension sends: ``with nbdist.bench.traffic(mesh) as t: step()`` on the ranks.

Every collective issued inside the block is counted against the **mesh dimension** whose process
group it ran on (``tp``, ``dp``, ``dp_shard``...), ``"world"`` for the default group when no
dimension is the whole world, ``"other"`` for any other group: per dimension and op, how many calls
and how many bytes, per step.

How a collective is tied to its group: torch's profiler (what :func:`nbdist.bench.trace` reads)
records the op and its shapes, but not the process group -- in torch 2.13 the group argument of a
``c10d::`` event comes back empty (``concrete_inputs``, ``kwinputs``, ``extra_meta`` and
``metadata_json`` all checked), and gloo runs each group's work on threads the profiler does not
name. So the block runs under a ``TorchDispatchMode`` (the mechanism of torch's own
``CommDebugMode``) that sees each collective as it is dispatched, with its arguments: the
``ProcessGroup`` of a ``c10d`` op (FSDP2's all_gather and reduce_scatter, ``dist.*`` calls) or the
group name of a functional collective (DTensor's redistributions, i.e. tensor parallel). Nothing is
changed: the op runs as it would. Limits: a collective issued on another thread than the one that
entered the block (or from C++ code that bypasses the dispatcher) is not seen. Point-to-point ops
(a pipeline's send/recv) are counted like the others; a send's wire factor is 1, a recv's 0.

``bytes`` follows nccl-tests (:mod:`nbdist.bench.units`): the largest buffer of the op -- the
tensor for all_reduce, the gathered output for all_gather, the input for reduce_scatter. What an
op puts on the wire per rank is that times the op's bus factor; :meth:`Traffic.compare` shows it
for NCCL's algorithms and for the backend measured (gloo has no reduce-scatter of its own: it
all-reduces the whole input, so its reduce_scatter moves ``2 (n-1)/n`` of the input, not
``(n-1)/n``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, Iterator, Optional

from ..report.table import Column
from .records import Table
from .trace import _CALLS
from .units import bus_factor

# functional collectives (DTensor's) -> op; their wait/autograd helpers are not collectives
_FUNCOL = {"all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
           "all_gather_into_tensor": "all_gather",
           "all_gather_into_tensor_coalesced": "all_gather",
           "all_gather_into_tensor_out": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter",
           "reduce_scatter_tensor_coalesced": "reduce_scatter",
           "all_to_all_single": "all_to_all", "broadcast": "broadcast"}
# backends that have no reduce-scatter of their own and all-reduce the whole input instead
_RS_AS_ALL_REDUCE = ("gloo",)


def wire_factor(op: str, n: int, backend: str = "nccl") -> Optional[float]:
    """Bytes each rank sends per byte of ``op``'s size on ``n`` ranks: nccl-tests' bus factor,
    except that a backend without a reduce-scatter of its own (gloo) all-reduces the whole input,
    so its reduce_scatter counts as an all_reduce. A send sends its tensor (1), a recv nothing (0).
    ``None`` for ops with no factor (barrier)."""
    if n <= 1:
        return 0.0
    if op == "reduce_scatter" and any(b in backend for b in _RS_AS_ALL_REDUCE):
        op = "all_reduce"
    if op in ("send", "recv"):  # point to point: a send puts its tensor on the wire, a recv
        return 1.0 if op == "send" else 0.0  # takes it off (the sender counts it)
    try:
        return bus_factor(op, n)
    except (KeyError, ValueError):
        return None


def _nbytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _dims(mesh) -> Dict[str, str]:
    """``{process group name: mesh dimension}`` for this rank, plus ``"world"``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("traffic() needs torch.distributed initialised: use it on the ranks, "
                           "e.g. inside group.run(fn) or a %%dist cell")
    out: Dict[str, str] = {}
    if mesh is not None:
        names = getattr(mesh, "mesh_dim_names", None)
        if not names:
            raise TypeError("traffic(mesh=...) takes a DeviceMesh with named dimensions (what "
                            "nbdist.parallel.device_mesh(...) returns), got "
                            f"{type(mesh).__name__}")
        world = dist.get_world_size()
        if mesh.size() != world or mesh.get_coordinate() is None:
            raise ValueError(f"the mesh {dict(zip(names, mesh.shape))} covers {mesh.size()} "
                             f"ranks but this group has {world}: pass the whole mesh of this "
                             "group (nbdist.parallel.device_mesh(...) with sizes multiplying to "
                             "the world size), not a sub-mesh such as mesh['tp']")
        for name in names:
            out.setdefault(mesh.get_group(name).group_name, name)
    out.setdefault(dist.group.WORLD.group_name, "world")
    return out


def _tap_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Tap(TorchDispatchMode):
        """Records ``(op, group, bytes, dtype)`` of each collective dispatched; runs it unchanged."""

        def __init__(self, on_call):
            super().__init__()
            self.on_call = on_call

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            op = (_CALLS.get(name) if ns == "c10d" else
                  _FUNCOL.get(name) if ns == "_c10d_functional" else None)
            if op is not None:
                group = None
                for arg, value in zip(func._schema.arguments, args):
                    if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(arg.type):
                        group = torch.distributed.ProcessGroup.unbox(value)
                    elif arg.name == "group_name" and isinstance(value, str):
                        from torch.distributed.distributed_c10d import _resolve_process_group

                        group = _resolve_process_group(value)
                if "group_name" in kwargs:
                    from torch.distributed.distributed_c10d import _resolve_process_group

                    group = _resolve_process_group(kwargs["group_name"])
                tensors = [a for a in list(args) + [out] if _nbytes(a)]
                dtype = next((str(t.dtype).replace("torch.", "") for t in _flat(tensors)), None)
                size = 0 if op == "barrier" else max((_nbytes(a) for a in tensors), default=0)
                self.on_call(op, group, size, dtype)
            return out

    return _Tap


def _flat(values) -> Iterator[Any]:
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flat(v)
        else:
            yield v


class Traffic(Table):
    """Collectives per mesh dimension, recorded by :func:`traffic`: one row per rank, dimension
    and op -- ``rank``, ``dim``, ``ranks`` (the group's size), ``op``, ``calls`` and ``bytes``
    (per step: the block's totals divided by ``steps``), ``dtype``, ``backend``.

    Plain data: return it from the ranks and ``Traffic.merge(g.run(fn))`` in the notebook.
    :meth:`summary` averages over ranks; :meth:`compare` puts the analytic figure of
    :func:`nbdist.bench.expected_traffic` next to it.
    """

    def _column(self, key: str) -> Column:
        if key == "calls":
            return Column(key, "calls/step")
        if key == "bytes":
            return Column(key, "bytes/step", "bytes")
        return super()._column(key)

    @classmethod
    def merge(cls, records: Iterable["Traffic"]) -> "Traffic":
        """One record with the rows of several (``Traffic.merge(g.run(fn))``)."""
        out = cls()
        for rec in records:
            if not isinstance(rec, Traffic):
                raise TypeError("Traffic.merge() takes Traffic records (what traffic() yields on "
                                f"the ranks), got {type(rec).__name__}")
            out.extend(dict(r) for r in rec)
        out.sort(key=lambda r: (r["rank"], r["dim"], r["op"]))
        return out

    def summary(self) -> "Traffic":
        """Per dimension and op, averaged over the ranks recorded: ``calls`` and ``bytes`` per
        step per rank, and ``wire_bytes``: what each rank sends per step on this backend."""
        rows: Dict[tuple, Dict[str, Any]] = {}
        ranks = len({r["rank"] for r in self}) or 1
        for r in self:
            row = rows.setdefault((r["dim"], r["op"]), {
                "dim": r["dim"], "ranks": r["ranks"], "op": r["op"], "calls": 0.0, "bytes": 0.0,
                "dtype": r["dtype"], "backend": r["backend"]})
            row["calls"] += r["calls"] / ranks
            row["bytes"] += r["bytes"] / ranks
        out = Traffic()
        for row in sorted(rows.values(), key=lambda r: (r["dim"], r["op"])):
            factor = wire_factor(row["op"], row["ranks"], row["backend"] or "")
            row["wire_bytes"] = None if factor is None else row["bytes"] * factor
            out.append(row)
        return out

    def compare(self, expected: Iterable[Dict[str, Any]]) -> Table:
        """Measured next to ``expected`` (rows with ``dim``, ``op``, ``calls``, ``bytes``, as
        :func:`nbdist.bench.expected_traffic` gives), per dimension and op, per rank and step:
        ``calls`` and ``expected_calls``; ``bytes`` and ``expected_bytes`` (nccl-tests' size,
        the algorithmic figure); ``ratio`` (bytes / expected); ``nccl_wire_bytes`` (what NCCL's
        ring algorithms send per rank for the expected ops) and ``wire_bytes`` (what the
        measured backend sends: on gloo a reduce_scatter is a whole all_reduce, twice NCCL's).
        """
        measured = {(r["dim"], r["op"]): r for r in self.summary()}
        wanted = {(e["dim"], e["op"]): e for e in expected}
        out = _Comparison()
        for key in sorted(set(measured) | set(wanted)):
            m, e = measured.get(key, {}), wanted.get(key, {})
            n = m.get("ranks") or e.get("ranks") or 1
            exp_bytes = e.get("bytes")
            nccl = wire_factor(key[1], n, "nccl")
            out.append({"dim": key[0], "ranks": n, "op": key[1], "calls": m.get("calls", 0),
                        "expected_calls": e.get("calls", 0), "bytes": m.get("bytes", 0),
                        "expected_bytes": exp_bytes,
                        "ratio": (m.get("bytes", 0) / exp_bytes) if exp_bytes else None,
                        "nccl_wire_bytes": (None if exp_bytes is None or nccl is None
                                            else exp_bytes * nccl),
                        "wire_bytes": m.get("wire_bytes")})
        return out


class _Comparison(Table):
    """:meth:`Traffic.compare`'s table: sizes in one binary unit per column, per rank and step."""

    def _column(self, key: str) -> Column:
        names = {"calls": "calls/step", "expected_calls": "expected calls/step",
                 "bytes": "measured", "expected_bytes": "algorithmic",
                 "nccl_wire_bytes": "sent by NCCL/rank", "wire_bytes": "sent here/rank"}
        if key in ("bytes", "expected_bytes", "nccl_wire_bytes", "wire_bytes"):
            return Column(key, names[key], "bytes", group="size")
        if key == "ratio":
            return Column(key, "measured/algorithmic", decimals=3)
        if key in names:
            return Column(key, names[key])
        return super()._column(key)


@contextlib.contextmanager
def traffic(mesh=None, steps: int = 1) -> Iterator[Traffic]:
    """Count the collectives issued inside the block per mesh dimension; yields a
    :class:`Traffic`, filled on exit. Use it on the ranks, around ``steps`` training steps.

    Args:
        mesh: the ``DeviceMesh`` the model was wrapped on (``nbdist.parallel.device_mesh(...)``,
            the whole mesh of this group); its dimension names label the rows. ``None``: only
            ``"world"`` and ``"other"``.
        steps: how many steps the block runs; calls and bytes are divided by it.
    """
    import torch.distributed as dist

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (steps run inside the block), got "
                         f"{steps!r}")
    dims = _dims(mesh)
    rank, backend = dist.get_rank(), str(dist.get_backend())
    totals: Dict[tuple, Dict[str, Any]] = {}

    def on_call(op, group, size, dtype):
        name = group.group_name if group is not None else dist.group.WORLD.group_name
        dim = dims.get(name, "other")
        n = group.size() if group is not None else dist.get_world_size()
        row = totals.setdefault((dim, op), {"rank": rank, "dim": dim, "ranks": n, "op": op,
                                            "calls": 0, "bytes": 0, "dtype": dtype,
                                            "backend": backend})
        row["calls"] += 1
        row["bytes"] += size

    rec = Traffic()
    with _tap_class()(on_call):
        yield rec
    for key in sorted(totals):
        row = totals[key]
        row["calls"] /= steps
        row["bytes"] /= steps
        rec.append(row)
