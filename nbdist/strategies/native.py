"""torch's own data-parallel wrappers: DDP, ZeroRedundancyOptimizer, FSDP1, FSDP2."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from torch import nn


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


def full_parameters(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full (unsharded) parameters of a wrapped model, as fp32 CPU copies, on every rank.

    A collective for the sharded strategies: call it on all ranks. Names are those of the original
    model (wrapper prefixes removed), so replicas and strategies can be compared.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    from . import deepspeed

    if deepspeed.is_engine(model):  # stage 3 partitions gathered
        return deepspeed.full_parameters(model)
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
