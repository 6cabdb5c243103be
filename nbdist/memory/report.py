"""Measured per-rank memory: records, the report that tabulates and plots them, ``measure``."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from .. import strategies as _strategies
from . import accounting
from .accounting import human_bytes, unit_for
from .formulas import _STAGES, MB, Estimate, estimate

@dataclass
class MemoryRecord:
    """One rank's memory under one strategy, in bytes; ``accuracy`` says how each was obtained.

    ``params``, ``grads``, ``optimizer``: unique storages (exact). ``other``: other tensors the
    process gained, after the step; ``in_flight``: the same between forward and backward
    (activations included). ``peak``: during the last step (``None`` when not measured). ``rss``,
    ``rss_base``: process RSS after and before the run. ``estimate``/``formula``: the ZeRO figure
    for ``model_state``; ``notes``: why they differ, where they do.
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
    in_flight: int
    peak: Optional[int]
    rss: Optional[int]
    rss_base: Optional[int]
    accuracy: Dict[str, str]
    notes: List[str] = field(default_factory=list)
    estimate: Optional[int] = None
    formula: str = ""

    @property
    def model_state(self) -> int:
        """params + grads + optimizer state (what the ZeRO formulas predict)."""
        return self.params + self.grads + self.optimizer

    @property
    def diff(self) -> Optional[float]:
        """Relative difference of the measured model state from the estimate."""
        return None if not self.estimate else self.model_state / self.estimate - 1.0


class MemoryReport(list):
    """A list of :class:`MemoryRecord` (rank-major per strategy) with a table and a plot."""

    def table(self) -> str:
        """A plain-text table (unit picked by size; rss in MB), then rank 0's notes per strategy."""
        scale, unit = unit_for(max([r.model_state for r in self] or [0]))
        cols = ("strategy", "rank", f"params {unit}", "grads", "optim", "state", "estimate",
                "diff", "other", "in-flight", "peak", "rss MB")
        rows = [cols]
        for r in self:
            rows.append((r.strategy, str(r.rank)) + tuple(
                _fmt(v, scale) for v in (r.params, r.grads, r.optimizer, r.model_state,
                                         r.estimate))
                + ("" if r.diff is None else f"{r.diff:+.1%}", _fmt(r.other, scale),
                   _fmt(r.in_flight, scale), _fmt(r.peak, scale), _fmt(r.rss, MB)))
        width = [max(len(row[i]) for row in rows) for i in range(len(cols))]
        lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in
                           enumerate(zip(row, width))) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        for r in self:
            if r.rank == 0 and r.notes:
                lines += [f"{r.strategy}: {note}" for note in r.notes]
        return "\n".join(lines)

    def to_dicts(self) -> List[Dict[str, Any]]:
        """The records as plain dicts (for JSON or ``pandas.DataFrame``)."""
        return [dict(asdict(r), model_state=r.model_state, diff=r.diff) for r in self]

    def plot(self, ax=None):
        """Stacked bars per rank and strategy with the estimate marked (needs matplotlib)."""
        from ..ui.plots.memory import plot_memory

        return plot_memory(self, ax=ax)


def _fmt(v: Optional[float], scale: float) -> str:
    return "-" if v is None else f"{v / scale:.2f}"




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
            ``{"ddp": {"gradient_as_bucket_view": False}}``.
    """
    for name in strategies:
        _strategies.get_strategy(name)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    estimate(1, 1, 0, precision, optimizer)  # validates precision and optimizer here
    report = MemoryReport()
    for name in strategies:
        for out in group.run(accounting.measure_on_rank, model_fn, name, optimizer, steps, batch,
                             precision, profile, input_fn, dict((options or {}).get(name, {}))):
            rec = MemoryRecord(**out)
            est = estimate(rec.num_params, rec.world_size, name, precision, optimizer)
            rec.estimate, rec.formula = est.total, est.formula
            rec.notes = _explain(rec, est) + rec.notes
            report.append(rec)
    return report


def _explain(rec: MemoryRecord, est: Estimate) -> List[str]:
    """Why a strategy's measured bytes differ from its formula, where they do."""
    notes = []
    if rec.strategy == "fsdp_grad_op":
        notes.append(f"after the step SHARD_GRAD_OP is at ZeRO-3 size (it reshards parameters "
                     f"after backward); ZeRO-2's full parameters exist between forward and "
                     f"backward: {human_bytes(rec.in_flight)} in flight (ZeRO-2 counts "
                     f"{human_bytes(est.params)} of parameters)")
    elif rec.diff is not None and abs(rec.diff) > 0.02:
        notes.append(f"model state differs from the {est.formula.split(':')[0]} formula by "
                     f"{rec.diff:+.1%}")
    return notes


def estimate_table(num_params: int, world_size: int, strategies: Sequence[str],
                   precision: str = "fp32", optimizer: str = "adam") -> str:
    """A plain-text table of :func:`estimate` for each strategy, with the formulas used."""
    rows = [("strategy", "stage", "params", "grads", "optimizer", "per rank")]
    formulas = []
    for name in strategies:
        e = estimate(num_params, world_size, name, precision, optimizer)
        rows.append((name, _STAGES[e.stage]) + tuple(human_bytes(v) for v in (
            e.params, e.grads, e.optimizer_state, e.total)))
        formulas.append(f"{name}: {e.formula}")
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, width))) for r in rows]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:] + formulas)
