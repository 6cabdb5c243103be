"""Memory of a pipeline stage: what :func:`nbdist.memory.measure` runs on a rank for ``"pp"``.

Every rank builds the whole model, keeps its stage(s) (:func:`nbdist.parallel.pipeline`) and drops
the rest, then trains ``steps`` pipeline steps of ``batch`` samples (the loss is the mean square
of the output, as for the other strategies). ``params``, ``grads`` and ``optimizer`` are the
unique storages of the local stages (exact); the formula is the stage's layers,
:func:`nbdist.memory.formulas.stage_estimate`. Options (``options={"pp": {...}}``): ``schedule``
(default ``"1f1b"``), ``microbatches`` (default: the number of stages), ``split``,
``stages_per_rank``.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from .. import parallel
from .. import strategies as _strategies
from . import accounting as _acc

_KNOWN = ("schedule", "microbatches", "split", "stages_per_rank")


def _squares(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def measure_on_rank(model_fn, name: str, optimizer: str, steps: int, batch: int, precision: str,
                    profile: bool, input_fn, options: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``steps`` pipeline steps of ``model_fn()`` here; return this rank's figures."""
    import torch.distributed as dist

    unknown = sorted(set(options) - set(_KNOWN) - {"device"})
    if unknown:
        raise ValueError(f"strategy 'pp' takes the options {', '.join(_KNOWN)}, got "
                         f"{', '.join(unknown)}")
    if precision != "fp32":
        raise ValueError("strategy 'pp' measures fp32 only: keep precision='fp32'")
    device = torch.device(options["device"]) if options.get("device") else \
        _strategies.default_device()
    warm = nn.Linear(2, 2)  # as accounting.measure_on_rank: torch._dynamo out of the baseline
    _acc.optimizer_fn(optimizer)(warm.parameters()).step()
    base = _acc._gc_storages()
    rss_base = _acc._trim_and_rss()
    torch.manual_seed(0)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    torch.manual_seed(1)
    x = (input_fn(batch) if input_fn else _acc._default_input(model, batch)).to(device)
    y = torch.zeros(batch, device=device)
    schedule = options.get("schedule", "1f1b")
    per_rank = options.get("stages_per_rank") or (2 if str(schedule).lower() in
                                                  ("interleaved1f1b",) else 1)
    pipe = parallel.pipeline(model, schedule,
                             options.get("microbatches", dist.get_world_size() * per_rank),
                             loss_fn=_squares, split=options.get("split"),
                             optimizer_fn=_acc.optimizer_fn(optimizer),
                             stages_per_rank=options.get("stages_per_rank"), device=device)
    del model  # the other stages' layers go with it
    local = nn.ModuleList(pipe.stage_modules)
    peak, prof, live = 0, None, 0
    for step in range(steps):
        if step == steps - 1:
            live = sum(v for k, v in _acc._gc_storages().items() if k not in base)
            prof = _acc._start_peak(device, profile)
        pipe.step(x, y)
        if step == steps - 1:
            peak = _acc._stop_peak(device, prof, live)
    params, grads, state = _acc._walk(local, pipe.optimizer)
    ignore = set(base) | set(params) | set(grads) | set(state) | {_acc._key(x), _acc._key(y)}
    others = {k: v for k, v in _acc._gc_storages().items() if k not in ignore}
    other = sum(others.values())
    notes = _acc.other_note(others)  # who holds it, where gc sees it
    held = "; ".join(f"stage {s}: " + (f"layer {first}" if last == first else
                                        f"layers {first}-{last}")
                     for s in pipe.stages for first, last in [(pipe.bounds[s][0],
                                                                pipe.bounds[s][1] - 1)])
    local_params = sum(p.numel() for p in local.parameters())
    held += f" of {pipe.bounds[-1][1]} ({pipe.schedule}, {pipe.microbatches} microbatches)"
    del local, pipe, x, y, prof
    rss = _acc._trim_and_rss()
    cuda = device.type == "cuda"
    src = ("exact (CUDA caching allocator, max_memory_allocated)" if cuda else
           "approximate (visible bytes before the step + largest rise of CPU allocations, "
           "torch profiler)" if profile else "not measured (pass profile=True on CPU)")
    return dict(strategy=name, rank=dist.get_rank(), world_size=dist.get_world_size(),
                device=str(device), num_params=num_params, params=sum(params.values()),
                grads=sum(grads.values()), optimizer=sum(state.values()), other=other,
                in_flight=None, peak=peak if (cuda or profile) else None, rss=rss,
                rss_base=rss_base, notes=notes, local_params=local_params, layers=held,
                accuracy=dict(params="exact (this rank's stages)", grads="exact",
                              optimizer="exact",
                              other="exact for Python-visible tensors; C++-only buffers not seen",
                              in_flight="not measured under pp (forward and backward of the "
                                        "microbatches interleave inside the schedule)",
                              peak=src, rss="approximate (whole process, after malloc_trim)"))
