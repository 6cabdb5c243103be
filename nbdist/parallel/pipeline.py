"""Pipeline parallelism on a group: ``pipeline(model, schedule="1f1b", microbatches=8, ...)``.

Every rank of the group calls :func:`pipeline` with the same arguments and the same model (built
with the same seed); each keeps only its own stage(s) of the model and runs them with
``torch.distributed.pipelining`` (``PipelineStage`` and ``ScheduleGPipe``, ``Schedule1F1B`` or
``ScheduleInterleaved1F1B``)::

    pipe = nbdist.parallel.pipeline(model, schedule="1f1b", microbatches=8,
                                    loss_fn=torch.nn.functional.mse_loss)
    loss = pipe.step(x, y)   # on every rank: a float on the last stage's rank, None elsewhere

**How the model is split.** ``model`` is an ``nn.Sequential``: its layers (children, in order)
are split into ``ranks x stages_per_rank`` stages of consecutive layers. By default the split is
even by layer count (the first ``L mod S`` stages get one layer more); ``split=[2, 5]`` gives the
index of the layer where each stage after the first begins (three stages: layers 0-1, 2-4, 5-).
A model that is not a ``Sequential`` can be passed as its stages already cut: a list with one
module per stage. Stage ``s`` runs on rank ``s mod ranks`` (for interleaved schedules, rank 0 holds
stages 0 and ``ranks``, ...). The stages are the model's own layers, not copies: after a step the
rank's part of ``model`` holds the new weights.

**What a step does.** ``step(x, y)`` splits the batch into ``microbatches`` equal microbatches
(the first stage takes ``x``, the last ``y``; the other ranks may pass anything, e.g. ``None``),
runs forward and backward of all of them in the schedule's order, then ``optimizer.step()`` on the
local stages. Gradients are averaged over microbatches, so with a mean-reducing ``loss_fn`` the
step is the full-batch step of one process. Before anything runs, the ranks agree (one small
all_reduce) that the batch is valid, so a bad batch raises the same error on every rank and leaves
the group usable.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from ._timeline import Recorder, Timeline

#: schedule name -> torch class name in ``torch.distributed.pipelining``
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved1f1b": "ScheduleInterleaved1F1B"}
_MULTI = {"interleaved1f1b"}  # schedules that run several stages per rank (2 by default)
_NOT_SEQUENTIAL = ("pipeline() splits an nn.Sequential by layer count, got {name}. Pass its "
                   "layers in order as nn.Sequential(...) (e.g. nn.Sequential(m.embed, *m.blocks, "
                   "m.head)), or pass the stages already cut: a list with one module per stage "
                   "({stages} here).")


def _check_int(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def plan(num_layers: int, ranks: int, schedule: str = "1f1b", microbatches: int = 1,
         split: Optional[Sequence[int]] = None,
         stages_per_rank: Optional[int] = None) -> List[Tuple[int, int]]:
    """The stages of a pipeline: ``[(first_layer, end_layer), ...]``, one per stage, in order.

    Checks everything that can be checked before a rank runs anything (the same on every rank):
    the schedule's name, the number of microbatches it needs, the split points, enough layers.
    """
    schedule, per_rank = _stages_per_rank(schedule, stages_per_rank)
    _check_int("microbatches", microbatches)
    stages = ranks * per_rank
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(f"schedule '1f1b' needs at least as many microbatches as stages "
                         f"(torch's Schedule1F1B): {stages} stages, microbatches={microbatches}. "
                         f"Use microbatches >= {stages}, or schedule='gpipe'.")
    rounds = max(1, microbatches // ranks)
    if schedule in _MULTI and microbatches % rounds:
        raise ValueError(f"schedule {schedule!r} needs microbatches to be a multiple of "
                         f"max(1, microbatches // ranks) = {rounds} (torch's rounds), got "
                         f"microbatches={microbatches} on {ranks} ranks: use a multiple of "
                         f"{ranks}, e.g. {ranks * rounds}")
    if num_layers < stages:
        raise ValueError(f"the model has {num_layers} layers but the pipeline has {stages} stages "
                         f"({ranks} ranks x {per_rank} per rank); each stage needs at least one "
                         f"layer: use a model with more layers or fewer stages")
    if split is None:
        size, extra = divmod(num_layers, stages)
        bounds = [0]
        for s in range(stages):
            bounds.append(bounds[-1] + size + (s < extra))
    else:
        points = list(split) if isinstance(split, (list, tuple)) else None
        if (points is None or len(points) != stages - 1
                or any(isinstance(p, bool) or not isinstance(p, int) for p in points)
                or points != sorted(set(points)) or (points and not 0 < points[0] <= points[-1]
                                                     < num_layers)):
            raise ValueError(f"split={split!r} is not valid: it lists the index of the layer where "
                             f"each stage after the first begins, so {stages} stages of a "
                             f"{num_layers}-layer model need {stages - 1} increasing ints in 1.."
                             f"{num_layers - 1} (e.g. split={_even_points(num_layers, stages)})")
        bounds = [0] + points + [num_layers]
    return list(zip(bounds[:-1], bounds[1:]))


def _stages_per_rank(schedule: str, stages_per_rank: Optional[int]) -> Tuple[str, int]:
    """The schedule's name (checked, lower case) and how many stages each rank runs."""
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid schedules: "
                         f"{', '.join(SCHEDULES)}")
    schedule = schedule.lower()
    per_rank = 2 if stages_per_rank is None and schedule in _MULTI else (stages_per_rank or 1)
    _check_int("stages_per_rank", per_rank)
    if per_rank > 1 and schedule not in _MULTI:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank, got stages_per_rank="
                         f"{per_rank}; use schedule='interleaved1f1b' for several")
    return schedule, per_rank


def _even_points(num_layers: int, stages: int) -> List[int]:
    return [a for a, _ in plan(num_layers, stages, "gpipe")[1:]] if num_layers >= stages else []


def _device(group) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Pipeline:
    """This rank's part of a pipeline built by :func:`pipeline`; call :meth:`step` on every rank.

    Attributes: ``optimizer`` (over the local stages' parameters), ``stage_modules`` (the local
    stages, ``nn.Sequential`` of the model's own layers), ``stages`` (their stage indices),
    ``layers`` (``{stage: [layer indices]}`` of the local stages), ``bounds`` (every stage's
    ``(first, end)`` layers), ``schedule``, ``microbatches``, ``rank``, ``ranks``,
    ``num_stages``, ``first`` / ``last`` (this rank feeds the inputs / the targets).
    """

    def __init__(self, stage_modules, stage_ids, bounds, schedule, microbatches, loss_fn,
                 optimizer_fn, group, device):
        from torch.distributed import pipelining as pp

        self.schedule, self.microbatches, self.group = schedule, microbatches, group
        self.rank, self.ranks = dist.get_rank(group), dist.get_world_size(group)
        self.num_stages, self.bounds = len(bounds), bounds
        self.stages = list(stage_ids)
        self.stage_modules = [m.to(device) for m in stage_modules]
        self.layers = {s: list(range(*bounds[s])) for s in self.stages}
        self.first, self.last = 0 in self.stages, self.num_stages - 1 in self.stages
        self.optimizer = optimizer_fn([p for m in self.stage_modules for p in m.parameters()])
        self._recorder = Recorder(self.rank, schedule, microbatches, self.ranks, self.num_stages)
        self._pp_stages = [pp.PipelineStage(m, s, self.num_stages, device, group=group)
                           for m, s in zip(self.stage_modules, self.stages)]
        for st in self._pp_stages:
            self._recorder.instrument(st)
        cls = getattr(pp, SCHEDULES[schedule])
        loss = self._recorder.timed_loss(loss_fn)
        if schedule in _MULTI:
            self._schedule = cls(self._pp_stages, n_microbatches=microbatches, loss_fn=loss)
        else:
            self._schedule = cls(self._pp_stages[0], n_microbatches=microbatches, loss_fn=loss)
        self._batch: Optional[Tuple[int, int]] = None  # (x batch, y batch) of the first step
        self.steps = 0

    def __repr__(self) -> str:
        held = ", ".join(f"stage {s}: layers {self.bounds[s][0]}-{self.bounds[s][1] - 1}"
                         for s in self.stages)
        return (f"<nbdist.parallel.Pipeline {self.schedule}, {self.microbatches} microbatches, "
                f"rank {self.rank} of {self.ranks}: {held}>")

    def _problems(self, x, y) -> List[str]:
        out = []
        for name, t, mine in (("x", x, self.first), ("y", y, self.last)):
            if not mine:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                out.append(f"{name} must be a batch tensor on the rank of the "
                           f"{'first' if name == 'x' else 'last'} stage, got "
                           f"{type(t).__name__}")
                continue
            n = t.shape[0]
            if n % self.microbatches:
                out.append(f"the batch of {n} ({name}) does not split into {self.microbatches} "
                           f"equal microbatches: use a batch that is a multiple of "
                           f"{self.microbatches}, or another microbatches=")
            elif self._batch is not None and n != self._batch[name == "y"]:
                out.append(f"the batch of {n} ({name}) differs from the first step's "
                           f"({self._batch[name == 'y']}): the stages' buffers are shaped on the "
                           f"first step; build a new pipeline for another batch size")
        return out

    def _agree(self, x, y) -> None:
        """Every rank learns whether any rank's batch is invalid, before anything is sent."""
        problems = self._problems(x, y)
        flag = torch.tensor([len(problems)], dtype=torch.int64)
        dist.all_reduce(flag, group=self.group)
        if flag.item():
            everyone: List[Any] = [None] * self.ranks
            dist.all_gather_object(everyone, problems, group=self.group)
            lines = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
            raise ValueError("pipeline step refused before anything ran; "
                             + "; ".join(lines))

    def step(self, x: Optional[torch.Tensor] = None, y: Optional[torch.Tensor] = None, *,
             record: bool = False) -> Optional[float]:
        """One training step of the whole batch; call it on every rank with the same arguments.

        The first stage's rank reads ``x`` and the last stage's rank ``y`` (others are ignored).
        Returns the loss (mean over microbatches) on the last stage's rank, ``None`` elsewhere.
        ``record=True`` also times every microbatch's forward and backward: see
        :attr:`last_timeline` and :meth:`timeline`.
        """
        self._agree(x, y)
        if self._batch is None:
            self._batch = (x.shape[0] if self.first else 0, y.shape[0] if self.last else 0)
        device = self._pp_stages[0].device
        args = (x.to(device),) if self.first else ()
        kwargs: Dict[str, Any] = {}
        losses: List[torch.Tensor] = []
        if self.last:
            kwargs = dict(target=y.to(device), losses=losses)
        self.optimizer.zero_grad()
        self._recorder.start(record)
        try:
            self._schedule.step(*args, **kwargs)
        finally:
            self._recorder.stop()
        self.optimizer.step()
        self.steps += 1
        return float(torch.stack([t.detach().float() for t in losses]).mean()) if self.last \
            else None

    @property
    def last_timeline(self) -> Optional[Timeline]:
        """The :class:`Timeline` of the last step run with ``record=True`` on this rank."""
        return self._recorder.timeline

    def timeline(self, x: Optional[torch.Tensor] = None,
                 y: Optional[torch.Tensor] = None) -> Timeline:
        """Run one training step with every microbatch timed; return this rank's
        :class:`Timeline` (``Timeline.merge(group.run(...))`` joins the ranks').

        A pipeline that never stepped runs one step first, unrecorded: the first step infers
        the shapes the stages exchange and warms the connections up. Both are real steps.
        """
        if self.steps == 0:
            self.step(x, y)
        self.step(x, y, record=True)
        return self._recorder.timeline


def pipeline(model: Union[nn.Sequential, Sequence[nn.Module]], schedule: str = "1f1b",
             microbatches: int = 4, *, loss_fn: Callable[[torch.Tensor, torch.Tensor],
                                                         torch.Tensor],
             split: Optional[Sequence[int]] = None,
             optimizer_fn: Optional[Callable] = None, stages_per_rank: Optional[int] = None,
             group=None, device: Any = None) -> Pipeline:
    """This rank's part of a pipeline over the group's ranks; call it on every rank alike.

    Args:
        model: an ``nn.Sequential`` (split by layer count, or at ``split``), the same on every
            rank; or a list with one module per stage, already cut.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved1f1b"`` (2 stages per rank).
        microbatches: equal microbatches per step (the batch must be a multiple of it).
        loss_fn: ``(output, target) -> loss`` of one microbatch, e.g.
            ``torch.nn.functional.mse_loss``; mean-reducing, so the step is the full batch's.
        split: the index of the layer where each stage after the first begins
            (``ranks * stages_per_rank - 1`` increasing ints); default: even by layer count.
        optimizer_fn: ``params -> Optimizer`` for the local stages (default
            ``torch.optim.SGD`` with ``lr=0.01``).
        stages_per_rank: stages on each rank (1; 2 for ``"interleaved1f1b"``).
        group: the process group of the pipeline's ranks (default: the whole group).
        device: where the stages run (default: CUDA under NCCL, else the CPU).
    """
    if not dist.is_initialized():
        raise RuntimeError("pipeline() needs torch.distributed initialised: call it on the "
                           "ranks, e.g. in %%dist or group.run(fn) of a group from "
                           "nbdist.start().")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> loss, e.g. "
                        f"torch.nn.functional.mse_loss; got {type(loss_fn).__name__}")
    if optimizer_fn is None:
        optimizer_fn = functools.partial(torch.optim.SGD, lr=0.01)
    elif not callable(optimizer_fn):
        raise TypeError("optimizer_fn must build the optimizer from parameters, e.g. "
                        "functools.partial(torch.optim.SGD, lr=0.1); got "
                        f"{type(optimizer_fn).__name__}")
    ranks = dist.get_world_size(group)
    if isinstance(model, (list, tuple)) and not isinstance(model, nn.Module):
        if split is not None:
            raise ValueError("split= applies to an nn.Sequential; a list of modules is already "
                             "one module per stage")
        if not all(isinstance(m, nn.Module) for m in model):
            raise TypeError("a model given as a list must hold one nn.Module per stage")
        stages = ranks * _stages_per_rank(schedule, stages_per_rank)[1]
        if len(model) != stages:
            raise ValueError(f"{len(model)} stage modules for {stages} stages ({ranks} "
                             f"ranks): pass one module per stage")
        bounds = plan(len(model), ranks, schedule, microbatches, None, stages_per_rank)
        cut = list(model)
    elif isinstance(model, nn.Sequential):
        layers = list(model.children())
        bounds = plan(len(layers), ranks, schedule, microbatches, split, stages_per_rank)
        cut = [nn.Sequential(*layers[a:b]) for a, b in bounds]
    else:
        stages = ranks * _stages_per_rank(schedule, stages_per_rank)[1]
        raise TypeError(_NOT_SEQUENTIAL.format(name=type(model).__name__, stages=stages))
    rank = dist.get_rank(group)
    mine = [s for s in range(len(bounds)) if s % ranks == rank]
    dev = torch.device(device) if device is not None else _device(group)
    return Pipeline([cut[s] for s in mine], mine, bounds, schedule.lower(), microbatches,
                    loss_fn, optimizer_fn, group, dev)


__all__ = ["Pipeline", "SCHEDULES", "pipeline", "plan"]
