"""Measured per-rank memory: records, the report that tabulates and plots them, ``measure``."""
from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

import cloudpickle
import torch
from torch import nn

from .. import strategies as _strategies
from . import accounting
from . import pipeline as _pipeline
from ..report.table import Column, TableView, unit_of
from ..report.units import format_bytes
from .formulas import _STAGES, Estimate, estimate, stage_estimate
from .notes import _fold, _in_unit, _notes, _rss_note, _stages_note
from .sharding import explain as _explain_split, mesh_estimate

@dataclass
class MemoryRecord:
    """One rank's memory under one strategy, in bytes; ``accuracy`` says how each was obtained.

    ``params``, ``grads``, ``optimizer``: unique storages (exact). ``other``: other tensors the
    process gained, after the step; ``in_flight``: the same between forward and backward
    (activations included; ``None`` where not measured: under ``"pp"``). ``peak``: during the
    last step (``None`` when not measured). ``rss``, ``rss_base``: process RSS after and before
    the run. ``estimate``/``formula``: the ZeRO figure for ``model_state`` (for ``"pp"``: the
    stage's layers, ``local_params`` of them, which ``layers`` names); ``notes``: why they
    differ, where they do.
    """

    strategy: str
    rank: int
    world_size: int
    device: str
    num_params: int
    params: int
    grads: int
    optimizer: int
    other: int
    in_flight: Optional[int]
    peak: Optional[int]
    rss: Optional[int]
    rss_base: Optional[int]
    accuracy: Dict[str, str]
    notes: List[str] = field(default_factory=list)
    estimate: Optional[int] = None
    formula: str = ""
    local_params: Optional[int] = None  #: parameters of this rank's pipeline stage(s) ("pp")
    layers: str = ""  #: the layers this rank holds ("pp"), e.g. "stage 0: layers 0-3"
    #: ``tp``/``fsdp2+tp``/``hsdp``: local bytes per class (:func:`nbdist.memory.sharding.split_on_rank`)
    split: Optional[Dict[str, Any]] = None

    @property
    def sharded(self) -> Optional[int]:
        """Local bytes of params + grads + optimizer state of the parameters the plan (or FSDP2
        under ``hsdp``) shards; ``None`` outside the mesh strategies."""
        return None if self.split is None else sum(
            self.split["sharded"][k] for k in ("params", "grads", "optimizer"))

    @property
    def replicated(self) -> Optional[int]:
        """The same for the parameters whole on every tensor-parallel rank (norms, Rowwise
        biases, layers left out of the plan); under ``fsdp2+tp`` FSDP2 shards them over dp."""
        return None if self.split is None else sum(
            self.split["replicated"][k] for k in ("params", "grads", "optimizer"))

    @property
    def model_state(self) -> int:
        """params + grads + optimizer state (what the ZeRO formulas predict)."""
        return self.params + self.grads + self.optimizer

    @property
    def diff(self) -> Optional[float]:
        """Relative difference of the measured model state from the estimate."""
        return None if not self.estimate else self.model_state / self.estimate - 1.0


_STATE = [("params", "params"), ("grads", "grads"), ("optimizer", "optim"),
          ("model_state", "state"), ("estimate", "estimate"), ("sharded", "sharded"),
          ("replicated", "replicated")]
_COLUMNS = ([Column("strategy", kind="text"), Column("rank", kind="number")]
            + [Column(key, name, "bytes", group="state") for key, name in _STATE]
            + [Column("diff", kind="fraction", decimals=1, signed=True)]
            + [Column(key, name, "bytes") for key, name in (
                ("other", "other"), ("in_flight", "in-flight"), ("peak", "peak"))])
_BYTES = ("params", "grads", "optimizer", "model_state", "estimate", "sharded", "replicated",
          "other", "in_flight", "peak", "rss", "rss_base")
_IN_FLIGHT = ("in-flight: tensors created by the last step's forward and alive at its backward: "
              "activations, what a strategy unshards for backward, and any collective's buffer not "
              "yet freed at that moment")
_FSDP2_FLIGHT = " (FSDP2's all-gather buffer, one layer's shard: on some runs and ranks only)"
_PP_FLIGHT = ("in-flight under pp: not measured (a pipeline's forwards and backwards of different "
              "microbatches interleave); Timeline.in_flight() gives the most microbatches whose "
              "activations a rank holds at once")
_NO_PEAK = ("peak: not measured on CPU (measure(..., profile=True) takes it from the torch "
            "profiler; on CUDA it is max_memory_allocated)")


def state_unit(records: Sequence[MemoryRecord]) -> str:
    """The binary unit of a memory table's sizes (and of its plot's axis): the largest in which
    every non-zero model-state figure (params, grads, optimizer, their sum, the estimate) is at
    least 1."""
    return unit_of("bytes", [getattr(r, k) for r in records for k, _ in _STATE]) or "B"


class MemoryReport(list):
    """A list of :class:`MemoryRecord` (rank-major per strategy) with a table and a plot.

    A notebook shows it as an HTML table, a terminal as text (:meth:`table`): one binary unit per
    column, named in its header (``params (KiB)``; the model-state columns share theirs); ranks of
    one strategy with equal figures in every column share a row (rank ``0-3``). Under
    it, each note once. The process RSS is a note (it is the whole process, torch included);
    the peak column appears where it was measured. The exports (:meth:`to_dicts`,
    :meth:`to_csv`, :meth:`to_pandas`) keep bytes.
    """

    def _view(self) -> TableView:
        meshed = any(r.split is not None for r in self)  # sharded / replicated: tp, fsdp2+tp, hsdp
        peak = any(r.peak is not None for r in self)
        columns = [c for c in _COLUMNS if (meshed or c.key not in ("sharded", "replicated"))
                   and (peak or c.key != "peak")]
        # every size in the unit of the model state: a 4-byte scalar in "other" must not put a
        # 257 KiB bucket next to it in bytes; the notes' sizes too (the process RSS aside)
        unit = state_unit(self)
        notes = [_in_unit(n, unit) for n in _notes(self)]
        fsdp2 = any(r.strategy.startswith("fsdp2") or r.strategy == "hsdp" for r in self)
        notes += [_IN_FLIGHT + (_FSDP2_FLIGHT if fsdp2 else "")] if any(
            r.in_flight for r in self) else []
        notes += [_PP_FLIGHT] if any(r.in_flight is None for r in self) else []
        notes += [] if peak or not self else [_NO_PEAK]
        notes += [n for n in (_rss_note(self),) if n]
        rows = self.to_dicts()
        columns = [replace(c, unit=unit) if c.kind == "bytes" and c.group != "state" else c
                   for c in columns]
        keys = ["strategy"] + [c.key for c in columns if c.key not in ("strategy", "rank")]
        return TableView(_fold(rows, keys), columns, notes)

    def table(self) -> str:
        """A plain-text table, each column in the unit of its header, then the notes."""
        return self._view().text()

    def _repr_html_(self) -> str:
        return self._view()._repr_html_()

    def __repr__(self) -> str:
        return f"<MemoryReport: {len(self)} records>\n{self.table()}"

    def to_dicts(self) -> List[Dict[str, Any]]:
        """The records as plain dicts (for JSON or ``pandas.DataFrame``); sizes in bytes."""
        return [dict(asdict(r), model_state=r.model_state, diff=r.diff, sharded=r.sharded,
                     replicated=r.replicated) for r in self]

    def _flat(self) -> List[Dict[str, Any]]:
        """One flat row per record, the unit in the name: ``params_bytes``, ``rss_bytes``..."""
        keep = ("strategy", "rank", "world_size", "device", "num_params")
        return [dict({k: d[k] for k in keep}, **{f"{k}_bytes": d[k] for k in _BYTES},
                     diff=d["diff"], formula=d["formula"], notes="; ".join(d["notes"]))
                for d in self.to_dicts()]

    def to_csv(self, path=None) -> Optional[str]:
        """Write CSV (bytes, in columns named ``params_bytes``...) to ``path`` (a file name or an
        open text file); return the text if no path."""
        rows = self._flat()
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [],
                                lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
        if path is None:
            return buf.getvalue()
        if hasattr(path, "write"):
            path.write(buf.getvalue())
        else:
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(buf.getvalue())
        return None

    def to_pandas(self):
        """The rows of :meth:`to_csv` as a ``pandas.DataFrame`` (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError("to_pandas() needs pandas (pip install pandas); to_csv() and "
                              "to_dicts() work without it.") from err
        return pd.DataFrame(self._flat())

    def plot(self, ax=None):
        """Stacked bars per rank and strategy with the estimate marked (needs matplotlib)."""
        from ..ui.plots.memory import plot_memory

        return plot_memory(self, ax=ax)



def measure(group, model_fn: Callable[[], nn.Module], strategies: Sequence[str] = ("ddp", "zero1",
            "fsdp"), optimizer: str = "adam", steps: int = 2, batch: int = 16, *,
            precision: str = "fp32", profile: bool = False,
            input_fn: Optional[Callable[[int], torch.Tensor]] = None,
            options: Optional[Dict[str, Dict[str, Any]]] = None) -> MemoryReport:
    """Train ``steps`` steps of ``model_fn()`` under each strategy on every rank of ``group``.

    Args:
        group: a running :class:`nbdist.Group`.
        model_fn: builds the full model (called on every rank with the same seed).
        strategies: registered strategy names, measured one after the other.
        optimizer: ``"adam"``, ``"adamw"``, ``"momentum"`` (SGD, momentum 0.9) or ``"sgd"``.
        steps: training steps (>= 1); figures are taken after the last one.
        batch: samples per rank; the input is ``input_fn(batch)`` or, by default, random data
            shaped for the model's first ``Linear``. The loss is the mean square of the output.
        precision: ``"fp32"`` or ``"bf16-mixed"`` (passed to :func:`nbdist.strategies.wrap`).
        profile: on CPU, measure the peak with the torch profiler (slower; opt-in).
        options: per-strategy ``wrap`` options, e.g.
            ``{"ddp": {"gradient_as_bucket_view": False}}``; for ``"pp"`` (pipeline stages,
            :mod:`nbdist.memory.pipeline`): ``schedule``, ``microbatches``, ``split``,
            ``stages_per_rank``, and ``batch`` is the whole pipeline's batch.
    """
    problem = model_fn_problem(model_fn)
    if problem is not None:
        raise TypeError(f"model_fn {problem}; pass a function the ranks call with no arguments "
                        "to build the model (an nn.Module), e.g. one defined in the notebook "
                        "or functools.partial(nbdist.memory.mlp, 4, 2236)")
    for name in strategies:
        _strategies.get_strategy(name)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    estimate(1, 1, 0, precision, optimizer)  # validates precision and optimizer here
    report = MemoryReport()
    for name in strategies:
        on_rank = _pipeline.measure_on_rank if name == "pp" else accounting.measure_on_rank
        first = len(report)
        for out in group.run(on_rank, model_fn, name, optimizer, steps, batch,
                             precision, profile, input_fn, dict((options or {}).get(name, {}))):
            rec = MemoryRecord(**out)
            if rec.split is not None:
                est = mesh_estimate(name, rec.split, rec.world_size, precision, optimizer)
            elif rec.local_params is not None:
                est = stage_estimate(rec.local_params, rec.num_params, rec.world_size, precision,
                                     optimizer, rec.layers)
            else:
                est = estimate(rec.num_params, rec.world_size, name, precision, optimizer)
            rec.estimate, rec.formula = est.total, est.formula
            rec.notes = (_explain_split(rec, est, rec.split) if rec.split is not None
                         else _explain(rec, est)) + rec.notes
            report.append(rec)
        stages = [r for r in report[first:] if r.local_params is not None]
        if stages:  # pp: the formula once, each rank's stage in one line, on every record
            note = _stages_note(stages)
            for rec in stages:
                rec.notes.insert(0, note)
    return report


def model_fn_problem(model_fn: Any) -> Optional[str]:
    """Why ``model_fn`` cannot build the model on the ranks (the end of a sentence about it), or
    ``None``: it must be callable, not a model itself, and picklable (it travels by value)."""
    if isinstance(model_fn, nn.Module):
        return f"is a model ({type(model_fn).__name__}), not a function that builds one"
    if not callable(model_fn):
        return f"is a{'n' if type(model_fn).__name__[0] in 'aeiou' else ''} " \
               f"{type(model_fn).__name__}, not a function that builds the model"
    try:
        cloudpickle.dumps(model_fn)
    except Exception as err:  # noqa: BLE001 -- cloudpickle raises many types
        first = (str(err).splitlines() or [""])[0][:200]
        return f"cannot be sent to the ranks (it cannot be pickled: {type(err).__name__}: {first})"
    return None


def _explain(rec: MemoryRecord, est: Estimate) -> List[str]:
    """Why a strategy's measured bytes differ from its formula, where they do."""
    notes = []
    if rec.strategy == "fsdp_grad_op":
        notes.append(f"after the step SHARD_GRAD_OP is at ZeRO-3 size (it reshards parameters "
                     f"after backward); ZeRO-2's full parameters exist between forward and "
                     f"backward: {format_bytes(rec.in_flight)} in flight (ZeRO-2 counts "
                     f"{format_bytes(est.params)} of parameters)")
    elif rec.diff is not None and abs(rec.diff) > 0.02:
        notes.append(f"model state differs from the {est.formula.split(':')[0]} formula by "
                     f"{rec.diff:+.1%}")
    return notes


_ESTIMATE_COLUMNS = [Column("strategy", kind="text"), Column("stage", kind="text")] + [
    Column(key, name, "bytes", group="bytes") for key, name in (
        ("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
        ("total", "per rank"))]


def estimate_table(num_params: int, world_size: int, strategies: Sequence[str],
                   precision: str = "fp32", optimizer: str = "adam", **parallel) -> TableView:
    """:func:`estimate` for each strategy as a table, with the formulas used under it.

    ``parallel``: :func:`estimate`'s keyword options (``tp``, ``pp``, ``replicated``,
    ``transformer``, ``sequence_parallel``, ``recompute``, ``microbatches``, ``schedule``);
    with ``transformer=`` an ``activations`` column, and the assumptions under the table.

    ``str()`` of the result is the plain-text table (``print`` it in a terminal); a notebook
    shows it as HTML. All sizes are in one binary unit, named in the headers.
    """
    rows, formulas = [], []
    for name in strategies:
        e = estimate(num_params, world_size, name, precision, optimizer, **parallel)
        stage = "PP" if name == "pp" and e.tp == 1 else _STAGES[e.stage]
        if e.tp > 1 or e.pp > 1:
            stage = f"{stage}, tp={e.tp}, pp={e.pp}, dp={e.dp}"
        rows.append({"strategy": name, "stage": stage, "params": e.params, "grads": e.grads,
                     "optimizer": e.optimizer_state, "total": e.total,
                     "activations": e.activations})
        formulas.append(f"{name}: {e.formula}")
    columns = list(_ESTIMATE_COLUMNS)
    if any(r["activations"] is not None for r in rows):
        columns.append(Column("activations", "activations", "bytes"))
        formulas.append(e.assumptions)
    return TableView(rows, columns, formulas)
