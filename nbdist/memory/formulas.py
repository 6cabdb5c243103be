"""The ZeRO paper's per-rank memory formulas (Rajbhandari et al., 2020), for any world size."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

from torch import nn

from .. import strategies as _strategies

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
    tp: int = 1  #: tensor-parallel size
    pp: int = 1  #: pipeline stages
    #: activation bytes on the first pipeline stage's ranks (``None`` without ``transformer=``)
    activations: Optional[int] = None
    assumptions: str = ""  #: how ``activations`` was computed, and from what

    @property
    def total(self) -> int:
        """params + grads + optimizer state, in bytes (the model state; activations apart)."""
        return self.params + self.grads + self.optimizer_state

    @property
    def dp(self) -> int:
        """Data-parallel size: world_size / (tp x pp)."""
        return self.world_size // (self.tp * self.pp)


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
             optimizer: str = "adam", *, tp: Optional[int] = None, pp: Optional[int] = None,
             replicated: int = 0, transformer=None, sequence_parallel: bool = False,
             recompute: Optional[str] = None, microbatches: Optional[int] = None,
             schedule: str = "1f1b") -> Estimate:
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

    Sharded parts use ceil(Ψ/N) parameters per rank. Buffers and temporaries are not part of the
    formulas.

    **Model parallel** (``tp=``, ``pp=``; Megatron-LM's 3-D layout, Narayanan et al. 2021): the
    world is ``dp x tp x pp`` ranks. Tensor parallel splits the layers' weights over tp
    (Shoeybi et al. 2019) except ``replicated`` parameters (norms, row-parallel biases: whole on
    every tp rank; default 0), a pipeline stage holds 1/pp of the layers, and ``strategy``'s ZeRO
    stage then applies over the dp ranks with N = dp to the rank's share::

        Ψ' = ((Ψ - Ψ_r)/tp + Ψ_r)/pp        stage formula above with Ψ', N = dp

    ``tp`` defaults to the world (over pp) for the strategy ``"tp"`` and to 1 otherwise; ``pp``
    to the world (over tp) for ``"pp"`` and to 1 otherwise. tp x pp must divide world_size.

    **Activations** (``transformer=Transformer(layers, hidden, heads, seq_len, micro_batch)``):
    per layer per Korthikanti et al. 2022 (:mod:`nbdist.memory.activations`: 16-bit, MLP 4h,
    attention scores stored), ``sequence_parallel`` and ``recompute`` (``"selective"``,
    ``"full"``) as in the paper, times L/pp layers, times the microbatches the first stage holds
    (1F1B: ``min(pp, microbatches)``; ``schedule="gpipe"``: all ``microbatches``). They are in
    ``Estimate.activations``, apart from ``total``; ``assumptions`` says how.
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
    if name == "pp" and tp is None and pp is None and transformer is None:
        return stage_estimate(math.ceil(num / world_size), num, world_size, precision, optimizer,
                              "an even split over N ranks: Ψ_stage ≈ Ψ/N")
    tp, pp = _model_parallel(name, world_size, tp, pp)
    acts, assumptions = None, ""
    if transformer is not None:
        from .activations import Transformer, activations

        if not isinstance(transformer, Transformer):
            raise TypeError(f"transformer must be an nbdist.memory.Transformer(layers, hidden, "
                            f"heads, seq_len, micro_batch), got {type(transformer).__name__}")
        acts, assumptions = activations(transformer, tp, pp, sequence_parallel, recompute,
                                        microbatches, schedule)
    if tp > 1 or pp > 1:
        if isinstance(replicated, bool) or not isinstance(replicated, int) or \
                not 0 <= replicated <= num:
            raise ValueError(f"replicated must be a parameter count from 0 to Ψ={num:,}, got "
                             f"{replicated!r}")
        local = math.ceil((math.ceil((num - replicated) / tp) + replicated) / pp)
        dp = world_size // (tp * pp)
        base = _zero(local, dp, stage, precision, optimizer)
        formula = (f"Ψ' = ((Ψ - Ψ_r)/tp + Ψ_r)/pp = {local:,} per rank (Megatron-LM: TP, Shoeybi "
                   f"et al. 2019; PP, Narayanan et al. 2021; Ψ={num:,}, Ψ_r={replicated:,}, "
                   f"tp={tp}, pp={pp}), then over dp={dp}: "
                   + base[3].replace("Ψ", "Ψ'").replace(f"Ψ'={local:,}, N={dp}", f"N=dp={dp}"))
        return Estimate(num, world_size, name, stage, precision, optimizer, *base[:3], formula,
                        tp, pp, acts, assumptions)
    shard = world_size
    if name == "hsdp":  # sharded inside dp_shard groups (the strategy's default), replicated across
        shard = _strategies.mesh_sizes("hsdp", world_size)["dp_shard"]
    params, grads, state, formula = _zero(num, shard, stage, precision, optimizer)
    if shard != world_size:
        formula += f" (HSDP: N = dp_shard = {shard} of {world_size} ranks)"
    return Estimate(num, world_size, name, stage, precision, optimizer, params, grads, state,
                    formula, tp, pp, acts, assumptions)


def _model_parallel(name: str, world_size: int, tp: Optional[int], pp: Optional[int]) -> tuple:
    """``(tp, pp)`` with their defaults, checked against the world size."""
    for label, value in (("tp", tp), ("pp", pp)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if tp is None:
        tp = world_size // (pp or 1) if name == "tp" else 1
    if pp is None:
        pp = world_size // tp if name == "pp" else 1
    if world_size % (tp * pp):
        valid = [(t, world_size // t // q, q) for t in range(1, world_size + 1)
                 for q in range(1, world_size + 1) if world_size % (t * q) == 0][:8]
        raise ValueError(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide world_size="
                         f"{world_size}: the world is dp x tp x pp ranks. Some that fit "
                         f"{world_size} ranks (tp, dp, pp): "
                         + ", ".join(f"({t}, {d}, {q})" for t, d, q in valid))
    return tp, pp


def _zero(num: int, world_size: int, stage: int, precision: str, optimizer: str) -> tuple:
    """``(params, grads, optimizer state, formula)`` bytes of ZeRO ``stage``."""
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
    return params, grads, state, formula


def stage_estimate(stage_params: int, num_params: int, world_size: int, precision: str = "fp32",
                   optimizer: str = "adam", layers: str = "") -> Estimate:
    """Pipeline parallelism: a rank holds its stage's layers whole, so its model state is the
    plain formula of the stage's Ψ_stage parameters, ``(P + G + K)Ψ_stage`` (strategy ``"pp"``;
    ``layers`` says which, e.g. ``"stage 0: layers 0-3 of 8"``)."""
    p = g = 4 if precision == "fp32" else 2
    k = OPTIMIZERS[optimizer][0 if precision == "fp32" else 1]
    formula = (f"PP: the stage's layers: (P + G + K)Ψ_stage = {p + g + k}Ψ_stage ({precision} "
               f"{optimizer}: P={p}, G={g}, K={k} bytes per parameter; Ψ_stage="
               f"{stage_params:,} of Ψ={num_params:,}, N={world_size}"
               f"{'; ' + layers if layers else ''})")
    return Estimate(num_params, world_size, "pp", 0, precision, optimizer, p * stage_params,
                    g * stage_params, k * stage_params, formula)


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
        layers, width = int(m.group(1)), int(m.group(2))
        if layers < 1 or width < 1:
            raise ValueError(f"--model mlp:LAYERSxWIDTH needs at least one layer of width 1 or "
                             f"more (e.g. mlp:4x2236), got {spec!r}")
        return functools.partial(mlp, layers, width)
    try:
        return parse_count(spec)
    except ValueError:
        raise ValueError(f"--model takes mlp:LAYERSxWIDTH (e.g. mlp:4x2236) or a parameter count "
                         f"(e.g. 7.5B), got {spec!r}") from None


@dataclass
class EstimateCurve:
    """:func:`estimate` of several strategies over a range of world sizes; ``plot()`` draws it."""

    num_params: int
    precision: str
    optimizer: str
    world_sizes: List[int]
    totals: Dict[str, List[int]] = field(default_factory=dict)  #: bytes per rank, per strategy

    def plot(self, ax=None, mark: Optional[int] = None, measured=None):
        """Log-log plot of per-rank model state against world size (needs matplotlib).

        ``mark``: a vertical line at one world size; ``measured``: MemoryRecords drawn as crosses.
        """
        from ..ui.plots.memory import plot_estimate

        return plot_estimate(self, ax=ax, mark=mark, measured=measured)


def estimate_curve(num_params, strategies: Sequence[str] = ("ddp", "zero1", "fsdp_grad_op", "fsdp"),
                   world_sizes: Optional[Sequence[int]] = None, precision: str = "fp32",
                   optimizer: str = "adam", **parallel) -> EstimateCurve:
    """Per-rank model-state bytes of each strategy for each world size (default 1, 2, 4 ... 4096).

    ``parallel``: :func:`estimate`'s ``tp=``, ``pp=``, ``replicated=`` (world sizes that tp x pp
    does not divide raise ``ValueError``)."""
    if not strategies:
        raise ValueError("estimate_curve() needs at least one strategy name, e.g. ['ddp', 'fsdp']")
    sizes = list(world_sizes or [2 ** i for i in range(13)])
    psi = estimate(num_params, 1, 0, precision, optimizer).num_params
    return EstimateCurve(psi, precision, optimizer, sizes, {
        name: [estimate(num_params, n, name, precision, optimizer, **parallel).total
               for n in sizes]
        for name in strategies})
