"""Strategies on a device mesh: ``tp``, ``fsdp2+tp`` and ``hsdp`` (built on :mod:`nbdist.parallel`).

* ``tp``: tensor parallel over the whole world (a 1-D ``tp`` mesh); every rank must be given the
  same batch. Options: ``plan`` (a ``parallelize_module`` plan, default
  :func:`nbdist.parallel.auto_plan`), ``sequence_parallel`` (the transformer plan with
  SequenceParallel norms).
* ``fsdp2+tp``: a ``dp x tp`` mesh; tensor parallel inside each ``tp`` group, then FSDP2
  (``fully_shard``, per module that owns parameters, then the root) over ``dp``. Ranks of one
  ``tp`` group get the same batch, ``dp`` groups different ones. Options: ``tp`` (default 2),
  ``plan``, ``sequence_parallel``, and ``fully_shard``'s ``reshard_after_forward``,
  ``mp_policy``, ``offload_policy``.
* ``hsdp``: FSDP2 on a 2-D ``dp_replicate x dp_shard`` mesh: parameters sharded inside each
  ``dp_shard`` group, the groups replicas of each other (gradients all-reduced across them).
  Every rank gets its own batch. Options: ``dp_shard`` (default: half the world when it is even,
  else the whole world) and ``fully_shard``'s options.

The model is changed in place (its layers become DTensor-sharded): build a fresh one per call.
The optimizer gets the parameters in one param group per mesh they live on (and one for plain
tensors), so torch's foreach optimizers never mix a DTensor with a tensor in one kernel.

ZeRO stage for the formulas (``Strategy.zero_stage``, used by :func:`nbdist.memory.estimate`):
3 for all three. That is only the estimate of a bare parameter count (Ψ/N, N the world;
``estimate(..., tp=)`` gives the model-parallel share). :func:`nbdist.memory.measure` compares
each rank with formulas from the model's actual split instead (:mod:`nbdist.memory.sharding`):
TP Ψ_s/tp + Ψ_r, 2-D Ψ_s/(dp·tp) + Ψ_r/dp, HSDP Ψ/dp_shard, where Ψ_r counts the replicated
pieces (norms, biases of Rowwise layers, layers the plan leaves out) whole on every tp rank.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel

_TP = ("plan", "sequence_parallel")
_FSDP = ("reshard_after_forward", "mp_policy", "offload_policy")


def _check_options(name: str, options: Dict, allowed) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"strategy {name!r} has no option {unknown[0]!r}; its options are: "
                         f"{', '.join(allowed)}")


def _size_option(name: str, option: str, value, world: int) -> int:
    valid = [d for d in range(1, world + 1) if world % d == 0]
    if isinstance(value, bool) or not isinstance(value, int) or value not in valid:
        raise ValueError(f"strategy {name!r}: {option}={value!r} does not divide the {world} "
                         f"ranks; valid {option} sizes for {world} ranks: "
                         f"{', '.join(map(str, valid))}")
    return value


def param_groups(model: nn.Module) -> List:
    """``model``'s parameters for ``optimizer_fn``: a plain list when they are all alike, else one
    param group per DeviceMesh (DTensor) plus one for plain tensors."""
    from torch.distributed.tensor import DTensor

    groups: Dict[object, List[torch.Tensor]] = {}
    for p in model.parameters():
        key = id(p.device_mesh) if isinstance(p, DTensor) else None
        groups.setdefault(key, []).append(p)
    if len(groups) == 1:
        return next(iter(groups.values()))
    return [{"params": ps} for ps in groups.values()]


def _fully_shard(model: nn.Module, mesh, precision: str, options: Dict) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "bf16-mixed":
        options.setdefault("mp_policy", MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32))
    for module in reversed(list(model.modules())):  # innermost first, the root last
        if module is not model and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)


def wrap_tp(model, optimizer_fn, device, precision, **options):
    """``tp``: tensor parallel over every rank."""
    _check_options("tp", options, _TP)
    mesh = parallel.device_mesh(tp=dist.get_world_size(), device_type=device.type)
    model = parallel.tensor_parallel(model.to(device), mesh["tp"], options.get("plan"),
                                     sequence_parallel=options.get("sequence_parallel", False))
    return model, optimizer_fn(param_groups(model))


def wrap_fsdp2_tp(model, optimizer_fn, device, precision, **options):
    """``fsdp2+tp``: tensor parallel over ``tp``, FSDP2 over ``dp``."""
    _check_options("fsdp2+tp", options, ("tp",) + _TP + _FSDP)
    world = dist.get_world_size()
    tp = _size_option("fsdp2+tp", "tp", options.pop("tp", 2 if world % 2 == 0 else world), world)
    tp_options = {k: options.pop(k) for k in _TP if k in options}
    mesh = parallel.device_mesh(dp=-1, tp=tp, device_type=device.type)
    model = parallel.tensor_parallel(model.to(device), mesh["tp"], tp_options.get("plan"),
                                     sequence_parallel=tp_options.get("sequence_parallel", False))
    _fully_shard(model, mesh["dp"], precision, options)
    return model, optimizer_fn(param_groups(model))


def wrap_hsdp(model, optimizer_fn, device, precision, **options):
    """``hsdp``: FSDP2 over a ``dp_replicate x dp_shard`` mesh."""
    _check_options("hsdp", options, ("dp_shard",) + _FSDP)
    world = dist.get_world_size()
    shard = _size_option("hsdp", "dp_shard", options.pop(
        "dp_shard", world // 2 if world % 2 == 0 else world), world)
    mesh = parallel.device_mesh(dp_replicate=-1, dp_shard=shard, device_type=device.type)
    model = model.to(device)
    _fully_shard(model, mesh, precision, options)
    return model, optimizer_fn(param_groups(model))
