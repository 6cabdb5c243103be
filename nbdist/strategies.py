"""Data-parallel strategies by name: wrap a model and its optimizer for the current rank.

``wrap("fsdp", model, optimizer_fn)`` returns ``(model, optimizer)`` ready to train on this rank
(CPU/gloo or CUDA/nccl), inside ``group.run(...)``. The registry maps each name to a wrapper, a
one-line description and the ZeRO stage whose memory formula it follows
(:func:`nbdist.memory.estimate`)::

    ddp                torch DDP, everything replicated                         ZeRO-0 (plain DP)
    zero1              DDP + torch ZeroRedundancyOptimizer (optimizer state)    ZeRO-1
    fsdp_grad_op       torch FSDP1, SHARD_GRAD_OP (grads + optimizer state)     ZeRO-2
    fsdp               torch FSDP1, FULL_SHARD (params, grads, state)           ZeRO-3
    fsdp2              torch FSDP2 ``fully_shard`` (params, grads, state)       ZeRO-3
    fairscale_oss      DDP + fairscale OSS                       (legacy path)  ZeRO-1
    fairscale_sharded  fairscale OSS + ShardedDataParallel       (legacy path)  ZeRO-2
    fairscale_fsdp     fairscale FullyShardedDataParallel (CUDA) (legacy path)  ZeRO-3

``optimizer_fn`` builds the optimizer from parameters: an optimizer class (``torch.optim.Adam``), a
``functools.partial(torch.optim.AdamW, lr=1e-3)`` or any ``params -> Optimizer`` callable. Extra
``**options`` go to the strategy's main torch/fairscale object (named in each description).
``precision="bf16-mixed"`` uses the strategy's own bf16 mixed precision (FSDP1, FSDP2, fairscale
FSDP); strategies without one refuse it -- use ``torch.autocast`` in the step instead.

FSDP1 and FSDP2 make each module that owns parameters its own FSDP unit (then the root), so one
layer at a time is unsharded; pass ``auto_wrap_policy=`` (FSDP1) to choose otherwise.

fairscale is an optional extra (``pip install nbdist[fairscale]``) and unmaintained upstream: its
strategies are the legacy path, kept to compare with and to run older code; prefer the torch ones.
Register your own with :func:`register_strategy`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed as dist
from torch import nn

PRECISIONS = ("fp32", "bf16-mixed")
FAIRSCALE_HINT = "pip install nbdist[fairscale]"


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


_REGISTRY: Dict[str, Strategy] = {}


def register_strategy(name: str, wrap_fn: Callable, description: str, zero_stage: int, *,
                      mixed_precision: bool = False, legacy: bool = False,
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
    info = Strategy(name, description, zero_stage, wrap_fn, mixed_precision, legacy)
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
    if info.legacy:
        _fairscale()
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


def default_device() -> torch.device:
    """Where :func:`wrap` trains by default: ``cuda:<current>`` under NCCL, else the CPU."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _fairscale():
    try:
        import fairscale  # noqa: F401
    except ImportError as err:
        raise ImportError("the fairscale strategies need fairscale, an optional extra: "
                          f"{FAIRSCALE_HINT} (fairscale is unmaintained upstream; the torch "
                          "strategies 'zero1', 'fsdp_grad_op', 'fsdp' and 'fsdp2' do the same "
                          "sharding)") from err
    return fairscale


def _owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _ddp(model, device, **options):
    """torch DDP with ``gradient_as_bucket_view=True`` unless the caller says otherwise.

    By default DDP's reducer copies every gradient into its own communication buckets, so the
    process holds the gradients twice (4Ψ bytes more in fp32, invisible to Python). With
    ``gradient_as_bucket_view=True`` the ``.grad`` tensors *are* views into those buckets: one copy.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    options.setdefault("gradient_as_bucket_view", True)
    ids = [device.index] if device.type == "cuda" else None
    return DDP(model.to(device), device_ids=ids, **options)


def _wrap_ddp(model, optimizer_fn, device, precision, **options):
    model = _ddp(model, device, **options)
    return model, optimizer_fn(model.parameters())


def _wrap_zero1(model, optimizer_fn, device, precision, **options):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _ddp(model, device)
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_fn,
                                          **options)


def _fsdp1(model, device, precision, strategy_name, **options):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if "auto_wrap_policy" not in options:  # one FSDP unit per module that owns parameters
        kinds = {type(m) for m in model.modules() if m is not model and _owns_params(m)}
        options["auto_wrap_policy"] = ModuleWrapPolicy(kinds) if kinds else None
    if precision == "bf16-mixed":
        options.setdefault("mixed_precision", MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16))
    # FSDP1 on CPU needs device_id=cpu explicitly, else "FSDP needs a non-CPU accelerator device".
    options.setdefault("device_id", device)
    return FSDP(model.to(device), sharding_strategy=getattr(ShardingStrategy, strategy_name),
                **options)


def _wrap_fsdp(model, optimizer_fn, device, precision, **options):
    model = _fsdp1(model, device, precision, "FULL_SHARD", **options)
    return model, optimizer_fn(model.parameters())


def _wrap_fsdp_grad_op(model, optimizer_fn, device, precision, **options):
    model = _fsdp1(model, device, precision, "SHARD_GRAD_OP", **options)
    return model, optimizer_fn(model.parameters())


def _wrap_fsdp2(model, optimizer_fn, device, precision, **options):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options.setdefault("mesh", init_device_mesh(device.type, (dist.get_world_size(),)))
    if precision == "bf16-mixed":
        options.setdefault("mp_policy", MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32))
    model = model.to(device)
    for module in reversed(list(model.modules())):  # innermost first, the root last
        if module is not model and _owns_params(module):
            fully_shard(module, **options)
    fully_shard(model, **options)
    return model, optimizer_fn(model.parameters())


def _wrap_fairscale_oss(model, optimizer_fn, device, precision, **options):
    """DDP + fairscale OSS (ZeRO-1): the legacy equivalent of ``zero1``."""
    from fairscale.optim import OSS

    model = _ddp(model, device)
    return model, OSS(model.parameters(), optim=optimizer_fn, **options)


def _wrap_fairscale_sharded(model, optimizer_fn, device, precision, **options):
    """fairscale OSS + ShardedDataParallel (ZeRO-2); reduces each grad to the rank that owns it.

    With fairscale's default ``reduce_buffer_size`` (2**23 elements), ShardedDDP keeps one unsharded
    reduce bucket per destination rank, and the gradients of other ranks' parameters that fit a
    bucket stay alive in it: per-rank gradient memory then exceeds ZeRO-2's 4Ψ/N (measured: no
    saving at all for 4 x 20 MB layers on 4 ranks). ``reduce_buffer_size=0`` frees them after each
    reduce and matches ZeRO-2 to the byte. nbdist keeps fairscale's default and reports the buckets.

    The optimizer's ``zero_grad()`` is routed to ``ShardedDataParallel.zero_grad()``, which also
    clears ShardedDDP's reduce buckets. torch >= 2.0 optimizers default to
    ``zero_grad(set_to_none=True)``; on OSS alone that leaves stale sums in the buckets, and
    training silently diverges from the 2nd step on (fairscale predates that default).
    """
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim import OSS

    model = model.to(device)
    optimizer = OSS(model.parameters(), optim=optimizer_fn)
    sharded = ShardedDataParallel(model, optimizer, **options)

    def zero_grad(set_to_none: bool = True) -> None:
        sharded.zero_grad(set_to_none=set_to_none)

    optimizer.zero_grad = zero_grad  # see the docstring: OSS.zero_grad alone trains wrong
    return sharded, optimizer


def _wrap_fairscale_fsdp(model, optimizer_fn, device, precision, **options):
    """fairscale FullyShardedDataParallel (ZeRO-3, CUDA only; not run on CPU-only CI)."""
    from fairscale.nn import FullyShardedDataParallel

    if precision == "bf16-mixed":
        options.setdefault("mixed_precision", True)
        options.setdefault("compute_dtype", torch.bfloat16)
    model = FullyShardedDataParallel(model.to(device), **options)
    return model, optimizer_fn(model.parameters())


def full_parameters(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full (unsharded) parameters of a wrapped model, as fp32 CPU copies, on every rank.

    A collective for the sharded strategies: call it on all ranks. Names are those of the original
    model (wrapper prefixes removed), so replicas and strategies can be compared.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, writeback=False):
            return _clean(dict(model.named_parameters()))
    if type(model).__module__.startswith("fairscale.nn.data_parallel.fully_sharded"):
        with model.summon_full_params(volatile=True):
            return _clean(dict(model.named_parameters()))
    inner = getattr(model, "module", model)
    return _clean({n: p.full_tensor() if isinstance(p, DTensor) else p
                   for n, p in inner.named_parameters()})


def _clean(params: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    out = {}
    for name, p in params.items():
        for prefix in ("_fsdp_wrapped_module.", "_fpw_module."):
            name = name.replace(prefix, "")
        out[name] = p.detach().float().cpu().clone()
    return out


register_strategy("ddp", _wrap_ddp, "torch DistributedDataParallel, gradient_as_bucket_view=True; "
                  "all replicated (options -> DDP)", 0)
register_strategy("zero1", _wrap_zero1, "DDP + torch ZeroRedundancyOptimizer: optimizer state "
                  "sharded (options -> ZeroRedundancyOptimizer)", 1)
register_strategy("fsdp_grad_op", _wrap_fsdp_grad_op, "torch FSDP1 SHARD_GRAD_OP ~ ZeRO-2: grads "
                  "and state sharded, params unsharded from forward to backward (options -> FSDP)",
                  2, mixed_precision=True)
register_strategy("fsdp", _wrap_fsdp, "torch FSDP1 FULL_SHARD ~ ZeRO-3: params, grads and state "
                  "sharded (options -> FSDP)", 3, mixed_precision=True)
register_strategy("fsdp2", _wrap_fsdp2, "torch FSDP2 fully_shard per module ~ ZeRO-3, DTensor "
                  "parameters (options -> fully_shard)", 3, mixed_precision=True)
register_strategy("fairscale_oss", _wrap_fairscale_oss, "legacy: DDP + fairscale OSS ~ ZeRO-1 "
                  "(options -> OSS)", 1, legacy=True)
register_strategy("fairscale_sharded", _wrap_fairscale_sharded, "legacy: fairscale OSS + "
                  "ShardedDataParallel ~ ZeRO-2 (options -> ShardedDataParallel)", 2, legacy=True)
register_strategy("fairscale_fsdp", _wrap_fairscale_fsdp, "legacy: fairscale "
                  "FullyShardedDataParallel ~ ZeRO-3, CUDA only (options -> its FSDP)", 3,
                  mixed_precision=True, legacy=True)
