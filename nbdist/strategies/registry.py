"""The strategy registry: names -> wrappers, refusing duplicates and listing valid names on a miss."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

PRECISIONS = ("fp32", "bf16-mixed")


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: ``wrap_fn(model, optimizer_fn, device, precision, **options)``.

    ``zero_stage`` is the ZeRO stage whose formula predicts its per-rank model-state memory;
    ``mixed_precision`` says whether it has bf16 mixed precision built in; ``legacy`` marks the
    unmaintained fairscale path.
    """

    name: str
    description: str
    zero_stage: int
    wrap_fn: Callable[..., Tuple[nn.Module, torch.optim.Optimizer]]
    mixed_precision: bool = False
    legacy: bool = False
    check: Optional[Callable[[], None]] = None  #: raises if an optional dependency is missing


_REGISTRY: Dict[str, Strategy] = {}


def register_strategy(name: str, wrap_fn: Callable, description: str, zero_stage: int, *,
                      mixed_precision: bool = False, legacy: bool = False,
                      check: Optional[Callable[[], None]] = None,
                      override: bool = False) -> Strategy:
    """Add a strategy to the registry; a name that is already taken is refused unless ``override``.

    The registry lives in each process: register where :func:`wrap` runs (on the ranks, e.g. in
    ``group.run`` or ``%%dist``), and in the kernel too if :func:`nbdist.memory.estimate` should
    know the name.
    """
    if name in _REGISTRY and not override:
        raise ValueError(f"strategy {name!r} is already registered "
                         f"({_REGISTRY[name].description}); register yours under another name, "
                         "or pass override=True to replace it.")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    info = Strategy(name, description, zero_stage, wrap_fn, mixed_precision, legacy, check)
    _REGISTRY[name] = info
    return info


def get_strategy(name: str) -> Strategy:
    """The registered :class:`Strategy` called ``name``; a miss lists the valid names."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"{name!r} not found in the strategy registry. Available names: "
                         f"{', '.join(_REGISTRY)}") from None


def available_strategies() -> Dict[str, str]:
    """``{name: description}`` of every registered strategy, in registration order."""
    return {name: s.description for name, s in _REGISTRY.items()}


def wrap(name: str, model: nn.Module, optimizer_fn: Callable, *, precision: str = "fp32",
         device: Any = None, **options) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap ``model`` with strategy ``name`` and build its optimizer; call it on every rank.

    Args:
        name: a registered strategy (see :func:`available_strategies`).
        model: the full model, identical on every rank (same seed); moved to ``device``.
            ``fsdp2`` shards it in place (its modules become FSDP modules): build a fresh one
            for each call.
        optimizer_fn: ``params -> Optimizer`` (an optimizer class, a ``functools.partial``...).
        precision: ``"fp32"`` or ``"bf16-mixed"`` (only where the strategy has it built in).
        device: where to train; default ``cuda:<current>`` when the group uses NCCL, else CPU.
        **options: passed to the strategy's main object (see the module docstring).

    Returns:
        ``(wrapped_model, optimizer)``.
    """
    info = get_strategy(name)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "fp32" and not info.mixed_precision:
        with_mp = [n for n, s in _REGISTRY.items() if s.mixed_precision]
        raise ValueError(f"strategy {name!r} has no built-in {precision} mixed precision; keep "
                         f"precision='fp32' and run the forward under torch.autocast(device_type, "
                         f"dtype=torch.bfloat16), or use one of: {', '.join(with_mp)}")
    if not callable(optimizer_fn):
        raise TypeError("optimizer_fn must build the optimizer from parameters, e.g. "
                        f"torch.optim.Adam or functools.partial(torch.optim.SGD, lr=0.1); got "
                        f"{type(optimizer_fn).__name__}")
    if info.check is not None:
        info.check()
    device = torch.device(device) if device is not None else default_device()
    if name == "fairscale_fsdp" and device.type != "cuda":
        raise ValueError("strategy 'fairscale_fsdp' needs CUDA: fairscale's "
                         "FullyShardedDataParallel keeps its full parameters on the GPU (device "
                         f"here: {device}). On CPU use 'fsdp' or 'fsdp2' (torch's FSDP, ZeRO-3) "
                         "instead.")
    if not dist.is_initialized():
        raise RuntimeError("wrap() needs torch.distributed initialised: call it on the ranks, "
                           "e.g. inside group.run(fn) of a group from nbdist.start().")
    return info.wrap_fn(model, optimizer_fn, device, precision, **options)


def _wrap_pp(model, optimizer_fn, device, precision, **options):
    """``pp`` is in the registry for :func:`nbdist.memory.measure`; training has its own call."""
    raise ValueError("strategy 'pp' (pipeline parallelism) does not wrap a model for the usual "
                     "forward/backward/step loop: train with nbdist.parallel.pipeline(model, "
                     "schedule='1f1b', microbatches=M, loss_fn=...) and its step(x, y) on every "
                     "rank. 'pp' is registered for nbdist.memory.measure(group, model_fn, "
                     "strategies=['pp'], options={'pp': {'schedule': '1f1b', 'microbatches': 4}})")


def default_device() -> torch.device:
    """Where :func:`wrap` trains by default: ``cuda:<current>`` under NCCL, else the CPU."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
