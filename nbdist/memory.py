"""Per-rank memory of sharded training: measured on a group, and estimated with the ZeRO formulas.

:func:`measure` trains a few real steps under each strategy on every rank and returns a
:class:`MemoryReport` of per-rank :class:`MemoryRecord` s. Each figure says how it was obtained:

* ``params`` / ``grads`` / ``optimizer`` -- **exact**: unique storages reachable from the model's
  parameters, their ``.grad`` and the optimizer state (DTensors counted by their local shard), each
  storage once, after the last step (grads, params and state all alive).
* ``other`` -- **exact for what Python sees**: every other tensor storage the process gained
  (gc walk): reduce buckets, unsharded parameters left over... C++-only buffers (DDP's reducer
  copy without ``gradient_as_bucket_view``) are invisible to it; the record's notes say so.
* ``in_flight`` -- the same walk between forward and backward of the last step (FSDP's unsharded
  parameters while they wait for backward).
* ``peak`` -- on CUDA the caching allocator's ``max_memory_allocated`` (exact); on CPU, opt-in with
  ``profile=True`` (the torch profiler slows the step down): Python-visible bytes before the step
  plus the largest rise of CPU allocations during it (approximate).
* ``rss`` -- process RSS after ``malloc_trim`` (approximate; includes torch itself, ~230 MB).

:func:`estimate` gives the analytic figures of the ZeRO paper (Rajbhandari et al., 2020) for any
world size -- how to plan a cluster from a laptop. This module imports no matplotlib or IPython;
:meth:`MemoryReport.plot` imports :mod:`nbdist.ui.plots.memory` when called.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from . import accounting
from . import strategies as _strategies
from .accounting import human_bytes, unit_for

MB = 1e6
# optimizer: (bytes of state per parameter in fp32, K of the ZeRO paper under mixed precision)
OPTIMIZERS = {"adam": (8, 12), "adamw": (8, 12), "momentum": (4, 8), "sgd": (0, 4)}
_STAGES = {0: "plain DP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


@dataclass(frozen=True)
class Estimate:
    """Per-rank model-state bytes predicted by the ZeRO formulas, and the formula used."""

    num_params: int
    world_size: int
    strategy: str
    stage: int
    precision: str
    optimizer: str
    params: int
    grads: int
    optimizer_state: int
    formula: str

    @property
    def total(self) -> int:
        """params + grads + optimizer state, in bytes."""
        return self.params + self.grads + self.optimizer_state


def count_params(model: nn.Module) -> int:
    """Ψ: the number of parameters of ``model``, shared parameters counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def parse_count(text: Union[str, int, float]) -> int:
    """``"7.5B"``, ``"125M"``, ``"20007728"`` or a number -> a parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e\+?[0-9]+)?)\s*([KMBGT]?)\s*", str(text), re.I)
    if not m or float(m.group(1)) * _SUFFIX[m.group(2).upper()] < 1:
        raise ValueError(f"expected a positive parameter count such as 20007728, 125M or 7.5B, "
                         f"got {text!r}")
    return int(round(float(m.group(1)) * _SUFFIX[m.group(2).upper()]))


def estimate(model_or_num_params: Union[nn.Module, int, float, str], world_size: int,
             strategy: Union[str, int], precision: str = "fp32",
             optimizer: str = "adam") -> Estimate:
    """Per-rank bytes of params, grads and optimizer state under ZeRO stage ``strategy``.

    ``strategy`` is a registered strategy name (its ZeRO stage is used) or a stage 0-3. With
    Ψ parameters, N ranks, P/G bytes per parameter and gradient and K bytes of optimizer state per
    parameter (``"bf16-mixed"`` Adam: P=G=2, K=12 -- fp32 master weights, momentum, variance --
    the paper's case; ``"fp32"`` Adam: P=G=4, K=8)::

        stage          formula            bf16-mixed Adam   fp32 Adam
        0 (plain DP)   (P + G + K)Ψ       16Ψ               16Ψ
        1 (ZeRO-1)     (P + G)Ψ + KΨ/N    4Ψ + 12Ψ/N        8Ψ + 8Ψ/N
        2 (ZeRO-2)     PΨ + (G + K)Ψ/N    2Ψ + 14Ψ/N        4Ψ + 12Ψ/N
        3 (ZeRO-3)     (P + G + K)Ψ/N     16Ψ/N             16Ψ/N

    ``optimizer="momentum"`` (SGD with momentum) has K=4 in fp32 and 8 mixed; plain ``"sgd"`` 0 and
    4 (the fp32 master copy).

    Sharded parts use ceil(Ψ/N) parameters per rank. Activations, buffers and temporaries are not
    part of the formulas.
    """
    if isinstance(model_or_num_params, nn.Module):
        num = count_params(model_or_num_params)
    elif isinstance(model_or_num_params, bool):
        raise TypeError("model_or_num_params must be an nn.Module or a parameter count, got bool")
    else:
        num = parse_count(model_or_num_params)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(strategy, int) and not isinstance(strategy, bool):
        if strategy not in _STAGES:
            raise ValueError(f"a ZeRO stage must be 0, 1, 2 or 3, got {strategy}")
        stage, name = strategy, _STAGES[strategy]
    else:
        stage, name = _strategies.get_strategy(strategy).zero_stage, strategy
    if precision not in _strategies.PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(_strategies.PRECISIONS)}, "
                         f"got {precision!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    p = g = 4 if precision == "fp32" else 2
    k = OPTIMIZERS[optimizer][0 if precision == "fp32" else 1]
    shard = math.ceil(num / world_size)
    params = p * (shard if stage == 3 else num)
    grads = g * (shard if stage >= 2 else num)
    state = k * (shard if stage >= 1 else num)
    terms = [f"{p}Ψ" if stage < 3 else f"{p}Ψ/N", f"{g}Ψ" if stage < 2 else f"{g}Ψ/N",
             f"{k}Ψ" if stage < 1 else f"{k}Ψ/N"]
    full = sum(c for c, s in ((p, 3), (g, 2), (k, 1)) if stage < s)
    short = " + ".join(x for x in (f"{full}Ψ" if full else "", f"{p + g + k - full}Ψ/N"
                                   if full < p + g + k else "") if x)
    formula = (f"{_STAGES[stage]}: {' + '.join(terms)} = {short} (ZeRO paper; {precision} "
               f"{optimizer}: P={p}, G={g}, K={k} bytes per parameter; Ψ={num:,}, N={world_size})")
    return Estimate(num, world_size, name, stage, precision, optimizer, params, grads, state,
                    formula)


def mlp(layers: int = 4, width: int = 2236) -> nn.Module:
    """``layers`` x ``Linear(width, width)`` with ReLU between; 4x2236 has Ψ = 20,007,728."""
    mods: List[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*mods)


def model_spec(spec: str):
    """``"mlp:4x2236"`` -> a picklable model function; a count (``"7.5B"``) -> that int."""
    m = re.fullmatch(r"mlp:(\d+)x(\d+)", spec.strip())
    if m:
        return functools.partial(mlp, int(m.group(1)), int(m.group(2)))
    try:
        return parse_count(spec)
    except ValueError:
        raise ValueError(f"--model takes mlp:LAYERSxWIDTH (e.g. mlp:4x2236) or a parameter count "
                         f"(e.g. 7.5B), got {spec!r}") from None


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
        from .ui.plots.memory import plot_memory

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


def cli(argv: List[str]) -> int:
    """``python -m nbdist mem``: measure on a fresh group (or only estimate, for a count)."""
    parser = argparse.ArgumentParser(
        prog="nbdist mem", description="Per-rank memory of data-parallel strategies, measured on "
        "a fresh group and set against the ZeRO formulas. A parameter count as --model (e.g. 7.5B) "
        "gives the estimate only, for any world size.")
    parser.add_argument("--model", default="mlp:4x2236",
                        help="mlp:LAYERSxWIDTH (default mlp:4x2236, 20M params) or a count (7.5B)")
    parser.add_argument("--strategies", default="ddp,zero1,fsdp",
                        help="comma-separated, from: "
                        + ", ".join(_strategies.available_strategies()))
    parser.add_argument("--world-size", "-n", type=int, default=2)
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--precision", default="fp32", choices=_strategies.PRECISIONS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--profile", action="store_true",
                        help="CPU: measure the step's peak with the torch profiler (slower)")
    parser.add_argument("--estimate", action="store_true", help="print the estimate only")
    parser.add_argument("--plot", metavar="PNG", help="save a plot to this file (matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="write the records as JSON")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    try:
        spec = model_spec(args.model)
        for name in names:
            _strategies.get_strategy(name)
        if isinstance(spec, int):
            num = spec
        else:
            with torch.device("meta"):  # count without allocating
                num = count_params(spec())
        estimate(num, args.world_size, 0, args.precision, args.optimizer)
    except ValueError as err:
        parser.error(str(err))
    plots = None
    if args.plot:
        try:
            from .ui.plots import memory as plots
        except ImportError as err:
            parser.error(f"--plot needs matplotlib ({err}); pip install nbdist[notebook]")
    if isinstance(spec, int) or args.estimate:
        print(estimate_table(num, args.world_size, names, args.precision, args.optimizer))
        if plots:
            ax = plots.plot_estimate(num, names, precision=args.precision,
                                     optimizer=args.optimizer, mark=args.world_size)
            ax.figure.savefig(args.plot, bbox_inches="tight")
        return 0
    import nbdist

    with nbdist.start(args.world_size, backend=args.backend) as group:
        report = measure(group, spec, names, args.optimizer, args.steps, args.batch,
                         precision=args.precision, profile=args.profile)
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dicts(), f, indent=1)
    if plots:
        report.plot().figure.savefig(args.plot, bbox_inches="tight")
    print(f"({len(report)} records; decimal units. 'state' = params + grads + optimizer, exact; "
          "'estimate' = the ZeRO formula; rss is approximate)")
    return 0
