"""Memory accounting on a rank: the unique-storage walk, the gc walk, the step's peak.

:func:`model_state_bytes` can be called on any rank (in ``%%dist`` or ``group.run``) on a wrapped
model and its optimizer. :func:`measure_on_rank` is what :func:`nbdist.memory.measure` runs on every
rank; it returns a plain dict that becomes a :class:`nbdist.memory.MemoryRecord`.

Storages are identified by (device, data pointer, size): a storage shared by several tensors
(views, DDP's bucket views, FSDP's flat parameters) counts once, in the first category that reaches
it (params, then grads, then optimizer state). DTensors count by their local shard.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .. import strategies as _strategies
from ..report.units import format_bytes, human_bytes, unit_for


def optimizer_fn(name: str):
    """The optimizer factory behind ``optimizer="adam" | "adamw" | "momentum" | "sgd"``."""
    return {"adam": functools.partial(torch.optim.Adam, lr=1e-3),
            "adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
            "momentum": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9),
            "sgd": functools.partial(torch.optim.SGD, lr=1e-2)}[name]


def _key(t: torch.Tensor) -> tuple:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):  # a tp model's output (RowwiseParallel's all_reduce)
        t = t.elem  # holds no storage of its own: the result's is the one to ignore
    s = t.untyped_storage()
    return (t.device.type, t.device.index, s.data_ptr(), s.nbytes())


def _storages(tensors) -> Dict[tuple, int]:
    from torch.distributed.tensor import DTensor

    out = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            k = _key(t)
            out[k] = k[3]
    return out


def _state_tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _state_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _state_tensors(v)


def _walk(model: nn.Module, opt, grads: Optional[Dict[tuple, int]] = None
          ) -> List[Dict[tuple, int]]:
    """Unique storages of params, grads, optimizer state; ``grads`` replaces the grads found
    now (DeepSpeed frees its gradient partitions inside ``step()``: they are taken before it)."""
    parts = _parts(opt)
    if parts is not None:  # DeepSpeed: its partitions, the fp32 master one with the optimizer
        groups = [parts["params"], parts["grads"], parts["master"] + parts["optimizer"]]
    else:
        params = list(model.parameters())
        opts = [opt] + [o for o in (getattr(opt, "optim", None),) if o is not None]  # ZeRO, OSS
        groups = [params, [p.grad for p in params if p.grad is not None],
                  [t for o in opts for t in _state_tensors(list(o.state.values()))]]
    found: List[Dict[tuple, int]] = []
    for i, tensors in enumerate(groups):
        seen = {k for d in found for k in d}
        now = grads if (i == 1 and grads is not None) else _storages(tensors)
        found.append({k: v for k, v in now.items() if k not in seen})
    return found


def _parts(opt) -> Optional[Dict[str, list]]:
    """DeepSpeed's tensors by kind (:meth:`nbdist.strategies.DeepSpeedOptimizer.memory_parts`)."""
    return opt.memory_parts() if callable(getattr(opt, "memory_parts", None)) else None


def model_state_bytes(model: nn.Module, optimizer) -> Dict[str, int]:
    """``{"params", "grads", "optimizer"}``: this rank's bytes, each unique storage counted once."""
    params, grads, state = _walk(model, optimizer)
    return {"params": sum(params.values()), "grads": sum(grads.values()),
            "optimizer": sum(state.values())}


def _gc_tensors() -> List[torch.Tensor]:
    # issubclass(type(o)), not isinstance: isinstance reads __class__, which warns on some objects
    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


def _gc_storages() -> Dict[tuple, int]:
    return _storages(_gc_tensors())


def _snapshot() -> Dict[tuple, Any]:
    """The storages alive now, each with a weak reference: a key (device, address, size) alone
    cannot tell a storage from a new one that the allocator put at the same address after it
    was freed (a buffer FSDP2 allocates each step then counted in one step and not the next)."""
    from torch.distributed.tensor import DTensor
    from torch.multiprocessing.reductions import StorageWeakRef

    out = {}
    for t in _gc_tensors():
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.layout == torch.strided and t.device.type != "meta":
            out[_key(t)] = StorageWeakRef(t.untyped_storage())
    return out


def _alive(snapshot: Dict[tuple, Any]) -> set:
    """The keys of ``snapshot`` whose storage is still the one it saw (not freed since)."""
    return {k for k, ref in snapshot.items() if not ref.expired()}


def other_note(others: Dict[tuple, int]) -> List[str]:
    """``["other: <holders>"]`` for the storages ``others`` (key -> bytes) where gc finds who
    holds them (:func:`_owners`); ``[]`` where it finds nobody."""
    holders = _owners(set(others)) if others else []
    return [f"other: {', '.join(holders)}"] if holders else []


def _owners(keys: set, limit: int = 3) -> List[str]:
    """Where the largest Python-visible tensors among ``keys`` are held, e.g.
    ``"DeviceMesh.mesh (8 B)"``: the attribute of the object that references each. A holder
    made before a forked rank's fork (frozen there: :mod:`nbdist.runtime.preload`) is out of
    the collector's sight, so such a tensor is described by its shape instead."""
    from torch.distributed.tensor import DTensor

    found: Dict[tuple, str] = {}
    for t in _gc_tensors():
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.layout != torch.strided or local.device.type == "meta":
            continue
        k = _key(local)
        if k in keys and k[3] and k not in found:
            found[k] = _holder(t)
    ranked = sorted(found.items(), key=lambda kv: -kv[0][3])[:limit]
    return [f"{name} ({format_bytes(k[3])})" for k, name in ranked]


def _holder(t: torch.Tensor) -> str:
    for ref in gc.get_referrers(t):
        if isinstance(ref, dict):
            attr = next((a for a, v in ref.items() if v is t), None)
            owner = next((o for o in gc.get_referrers(ref)
                          if getattr(o, "__dict__", None) is ref), None)
            if attr is not None and owner is not None:
                return f"{type(owner).__name__}.{attr}"
        elif not isinstance(ref, (list, tuple, set)) and type(ref).__name__ not in ("frame",
                                                                                     "cell"):
            # Python 3.11+ keeps most instances' attributes inline: the object refers directly
            attrs = getattr(ref, "__dict__", None)
            attr = next((a for a, v in attrs.items() if v is t), None) if attrs else None
            return type(ref).__name__ + (f".{attr}" if attr else "")
    return f"a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor"


def _trim_and_rss() -> int:
    import ctypes

    import psutil

    gc.collect()
    if sys.platform.startswith("linux"):  # glibc keeps freed memory until asked to return it
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


def _default_input(model: nn.Module, batch: int) -> torch.Tensor:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            return torch.randn(batch, m.in_features)
    raise ValueError(f"cannot tell what input {type(model).__name__} takes (no nn.Linear in it); "
                     "pass input_fn=lambda batch: <a batch of inputs> to measure()")


def measure_on_rank(model_fn, name: str, optimizer: str, steps: int, batch: int, precision: str,
                    profile: bool, input_fn, options: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``steps`` steps of ``model_fn()`` under strategy ``name`` here; return the figures."""
    import torch.distributed as dist

    device = torch.device(options["device"]) if options.get("device") else \
        _strategies.default_device()
    warm = nn.Linear(2, 2)  # the first optimizer imports torch._dynamo: keep it out of the baseline
    optimizer_fn(optimizer)(warm.parameters()).step()
    base = _snapshot()
    rss_base = _trim_and_rss()
    torch.manual_seed(0)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    torch.manual_seed(1 + dist.get_rank())
    x = (input_fn(batch) if input_fn else _default_input(model, batch)).to(device)
    model, opt = _strategies.wrap(name, model, optimizer_fn(optimizer), precision=precision,
                                  **options)
    cuda = device.type == "cuda"
    peak = in_flight = live = 0
    prof = known = grads_at_step = None
    for step in range(steps):
        last = step == steps - 1
        if last:
            known = _snapshot()
            before = _alive(base)
            live = sum(k[3] for k in known if k not in before)
            prof = _start_peak(device, profile)
        opt.zero_grad()
        out = model(x)
        if last:  # between forward and backward: unsharded parameters, activations
            ignore = _alive(known) | {_key(out)}
            in_flight = sum(v for k, v in _gc_storages().items() if k not in ignore)
        out.float().pow(2).mean().backward()
        if last and _parts(opt) is not None:  # DeepSpeed frees its gradient partitions in step()
            grads_at_step = _storages(_parts(opt)["grads"])
        opt.step()
        if last:
            peak = _stop_peak(device, prof, live)
    params, grads, state = _walk(model, opt, grads_at_step)
    # Garbage first: storages only reference cycles still hold are memory nobody holds, and
    # without this they would count or not by when Python last collected (with gc off, two FSDP2
    # steps of mlp(2, 64) leave 16,640 bytes of shard-sized buffers in cycles on each rank).
    gc.collect()
    ignore = _alive(base) | set(params) | set(grads) | set(state) | {_key(x), _key(out)}
    others = {k: v for k, v in _gc_storages().items() if k not in ignore}
    other = sum(others.values())
    notes = _rank_notes(model, grads) + _deepspeed_notes(opt, precision, sum(grads.values()))
    if 0 < other < 1024:  # a few bytes: name them, or the column reads as noise
        notes += other_note(others)
    from .sharding import MESHED, split_on_rank

    split = split_on_rank(model, opt, name) if name in MESHED else None
    del model, opt, out, x, known, prof
    rss = _trim_and_rss()
    src = ("exact (CUDA caching allocator, max_memory_allocated)" if cuda else
           "approximate (visible bytes before the step + largest rise of CPU allocations, "
           "torch profiler)" if profile else "not measured (pass profile=True on CPU)")
    return dict(strategy=name, rank=dist.get_rank(), world_size=dist.get_world_size(),
                device=str(device), num_params=num_params, params=sum(params.values()),
                grads=sum(grads.values()), optimizer=sum(state.values()), other=other,
                in_flight=in_flight, peak=peak if (cuda or profile) else None, rss=rss,
                rss_base=rss_base, notes=notes, split=split, accuracy=dict(
                    params="exact", grads="exact", optimizer="exact",
                    other="exact for Python-visible tensors; C++-only buffers not seen",
                    in_flight="exact for Python-visible tensors (activations included)",
                    peak=src, rss="approximate (whole process, after malloc_trim)"))


def _rank_notes(model: nn.Module, grads: Dict[tuple, int]) -> List[str]:
    """What only the rank can see: DDP's hidden gradient copy, ShardedDDP's buckets."""
    import torch.distributed as dist

    notes = []
    if getattr(model, "gradient_as_bucket_view", True) is False:
        notes.append(f"DDP's reducer also holds a copy of the gradients in C++ (about "
                     f"{format_bytes(sum(grads.values()))}, not counted here: see rss); "
                     "gradient_as_bucket_view=True avoids it")
    owner, buckets = (getattr(model, a, None) for a in ("_trainable_param_to_rank", "_bucket_list"))
    if owner is not None and buckets:  # fairscale ShardedDataParallel
        size = sum(_storages(b.buffer for b in buckets).values())
        foreign = sum(p.grad.nbytes for p, r in owner.items() if p.grad is not None
                      and r != dist.get_rank())
        notes.append(f"ShardedDDP keeps {len(buckets)} unsharded reduce buckets "
                     f"({format_bytes(size)}), one per destination rank; the gradients of other "
                     f"ranks' parameters that fit a bucket stay alive in it: "
                     f"{format_bytes(foreign)} of this rank's {format_bytes(sum(grads.values()))} "
                     "of grads (ZeRO-2 counts only its own 1/N). reduce_buffer_size=0 frees them "
                     "after each reduce and matches ZeRO-2, at one reduce per parameter")
    return notes


def _deepspeed_notes(opt, precision: str, grads: int) -> List[str]:
    """What DeepSpeed holds beyond the ZeRO formula: the fp32 master partition, buckets."""
    parts = _parts(opt)
    if parts is None:
        return []
    notes = []
    master = sum(_storages(parts["master"]).values())
    if precision == "fp32" and master:
        notes.append(f"DeepSpeed keeps an fp32 master copy of this rank's partition "
                     f"({format_bytes(master)}, in optim) next to the fp32 parameters: the "
                     "optimizer steps the copy and all-gathers it back into the parameters. The "
                     "fp32 formula counts K=8 bytes of optimizer state per parameter (Adam's two "
                     "moments) and no master copy, so optim is 4Ψ/N above it")
    engine = getattr(opt, "engine", None)
    if engine is not None and engine.zero_optimization_stage() == 1 and grads:
        notes.append(f"DeepSpeed's stage 1 also keeps only this rank's gradient partition at the "
                     f"step ({format_bytes(grads)} in grads; ZeRO-1 counts all gradients): the "
                     "full gradients live from backward until its epilogue reduces them")
    buckets = sum(_storages(parts["buckets"]).values())
    if buckets:
        notes.append(f"DeepSpeed's stage-3 reduce bucket ({format_bytes(buckets)}: "
                     "reduce_bucket_size elements, kept between steps) is in other")
    return notes


def _start_peak(device: torch.device, profile: bool):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return None
    if not profile:
        return None
    from torch.profiler import ProfilerActivity, profile as profiler

    prof = profiler(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_fd2():
        prof.__enter__()
    return prof


def _stop_peak(device: torch.device, prof, live: int) -> Optional[int]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    if prof is None:
        return None
    with _quiet_fd2():
        prof.__exit__(None, None, None)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    level = rise = 0
    for _, nbytes in events:
        level += nbytes
        rise = max(rise, level)
    return live + rise


@contextlib.contextmanager
def _quiet_fd2():
    """Kineto prints "USDT: profiler_start/stop" to fd 2 on every session, whatever
    KINETO_LOG_LEVEL says: hide fd 2 only while the profiler starts and stops."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
