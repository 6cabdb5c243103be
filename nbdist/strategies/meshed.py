"""Strategies on a device mesh: ``tp``, ``fsdp2+tp`` and ``hsdp`` (built on :mod:`nbdist.parallel`).

* ``tp``: tensor parallel over the whole world (a 1-D ``tp`` mesh); every rank must be given the
  same batch. Options: ``plan`` (a ``parallelize_module`` plan, default
  :func:`nbdist.parallel.auto_plan`), ``sequence_parallel`` (the transformer plan with
  SequenceParallel norms).
* ``fsdp2+tp``: a ``dp x tp`` mesh; tensor parallel inside each ``tp`` group, then FSDP2
  (``fully_shard``, per module that owns parameters, then the root) over ``dp``. Ranks of one
  ``tp`` group get the same batch, ``dp`` groups different ones. Options: ``tp`` (default 2 on
  an even world, else the whole world), ``plan``, ``sequence_parallel``, and ``fully_shard``'s
  ``reshard_after_forward``, ``mp_policy``, ``offload_policy``.
* ``hsdp``: FSDP2 on a 2-D ``dp_replicate x dp_shard`` mesh: parameters sharded inside each
  ``dp_shard`` group, the groups replicas of each other (gradients all-reduced across them).
  Every rank gets its own batch. Options: ``dp_shard`` (default: half the world when it is even,
  else the whole world) and ``fully_shard``'s options.

:func:`mesh_sizes` says which mesh each strategy builds for a world size (the defaults live
there; the launcher's strategy list and ``%dist_ui mesh`` show them).

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

from typing import Dict, List, Optional

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


def mesh_sizes(name: str, world_size: int, **options) -> Optional[Dict[str, int]]:
    """The mesh strategy ``name`` builds on ``world_size`` ranks: sizes by dimension name,
    outermost first; ``None`` for a strategy without a mesh (``ddp``, ``fsdp``...).

    ``mesh_sizes("fsdp2+tp", 4)`` -> ``{"dp": 2, "tp": 2}``; ``mesh_sizes("hsdp", 4)`` ->
    ``{"dp_replicate": 2, "dp_shard": 2}``; ``mesh_sizes("tp", 4)`` -> ``{"tp": 4}``;
    ``mesh_sizes("pp", 4)`` -> ``{"pp": 4}`` (one pipeline stage per rank, or
    ``stages_per_rank`` of them). The defaults are the ones :func:`nbdist.strategies.wrap` uses
    (this function is where they live): ``fsdp2+tp`` takes ``tp=2`` on an even world, else the
    whole world (``dp`` 1); ``hsdp`` takes ``dp_shard`` = half an even world, else the whole world
    (``dp_replicate`` 1). ``tp=`` / ``dp_shard=`` in ``options`` choose otherwise and must divide
    the world (``ValueError`` listing the valid sizes); the strategy's other options are ignored
    here, so a strategy's whole options dict can be passed.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    even = world_size % 2 == 0
    if name == "tp":
        return {"tp": world_size}
    if name == "pp":
        return {"pp": world_size}
    if name == "fsdp2+tp":
        tp = _size_option(name, "tp", options.get("tp", 2 if even else world_size), world_size)
        return {"dp": world_size // tp, "tp": tp}
    if name == "hsdp":
        shard = _size_option(name, "dp_shard", options.get(
            "dp_shard", world_size // 2 if even else world_size), world_size)
        return {"dp_replicate": world_size // shard, "dp_shard": shard}
    return None


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
    sizes = mesh_sizes("tp", dist.get_world_size())
    mesh = parallel.device_mesh(**sizes, device_type=device.type)
    model = parallel.tensor_parallel(model.to(device), mesh["tp"], options.get("plan"),
                                     sequence_parallel=options.get("sequence_parallel", False))
    return model, optimizer_fn(param_groups(model))


def wrap_fsdp2_tp(model, optimizer_fn, device, precision, **options):
    """``fsdp2+tp``: tensor parallel over ``tp``, FSDP2 over ``dp``."""
    _check_options("fsdp2+tp", options, ("tp",) + _TP + _FSDP)
    sizes = mesh_sizes("fsdp2+tp", dist.get_world_size(), **options)
    options.pop("tp", None)
    tp_options = {k: options.pop(k) for k in _TP if k in options}
    mesh = parallel.device_mesh(**sizes, device_type=device.type)
    model = parallel.tensor_parallel(model.to(device), mesh["tp"], tp_options.get("plan"),
                                     sequence_parallel=tp_options.get("sequence_parallel", False))
    _fully_shard(model, mesh["dp"], precision, options)
    return model, optimizer_fn(param_groups(model))


def wrap_hsdp(model, optimizer_fn, device, precision, **options):
    """``hsdp``: FSDP2 over a ``dp_replicate x dp_shard`` mesh."""
    _check_options("hsdp", options, ("dp_shard",) + _FSDP)
    sizes = mesh_sizes("hsdp", dist.get_world_size(), **options)
    options.pop("dp_shard", None)
    mesh = parallel.device_mesh(**sizes, device_type=device.type)
    model = model.to(device)
    _fully_shard(model, mesh, precision, options)
    return model, optimizer_fn(param_groups(model))
