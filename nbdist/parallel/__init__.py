"""Beyond data parallel, on the ranks: device meshes, tensor (+ sequence) parallel plans, pipelines.

Owns the rank-side torch code that the mesh-based strategies (``tp``, ``fsdp2+tp``, ``hsdp`` in
:mod:`nbdist.strategies`) and notebook users build on:

* :func:`device_mesh` -- a named torch ``DeviceMesh`` (``pp``, ``dp`` | ``dp_replicate`` x
  ``dp_shard``, ``tp``) over the group's default process group, sizes checked against the world
  (a wrong product lists the valid factorizations); :class:`MeshLayout` -- the same layout from
  sizes alone, in the kernel: which rank sits where, as text, HTML or a figure (``.plot()``);
* :func:`auto_plan` / :func:`tensor_parallel` / :func:`check_plan` -- tensor-parallel plans in
  ``parallelize_module``'s own format (``{module name: ParallelStyle}``), found for Linear stacks
  and transformer blocks (:mod:`nbdist.parallel.plans` lists what is recognised), with sequence
  parallel as an option of the transformer plan; :class:`TransformerBlock` -- a small GPT-style
  block written the way tensor parallel needs it;
* :func:`pipeline` -- an ``nn.Sequential`` split into stages over the ranks and trained with a
  ``torch.distributed.pipelining`` schedule (GPipe, 1F1B, interleaved 1F1B);
  :meth:`Pipeline.timeline` measures where each rank waits (:class:`Timeline`: a table, the
  bubble against the schedule's theory, a Gantt chart).

Context parallel (``torch.distributed.tensor.experimental.context_parallel``) is not offered: it
does not run on CPU in torch 2.13 (there is no CPU SDPA sharding strategy).

Layer (issue #19): below :mod:`nbdist.strategies` (which wraps models with it) and above
:mod:`nbdist.runtime`. May import: torch, the standard library and the parts below (runtime,
backends, wire, errors, report); never strategies, memory, bench, lightning or ui -- except the
lazy ``MeshLayout.plot()`` and ``Timeline.plot()``, which load :mod:`nbdist.ui.plots` when called
(as pandas' ``DataFrame.plot`` does).
"""
from __future__ import annotations

from ._timeline import Timeline
from .layout import DIMS, MeshLayout, factorizations
from .meshes import device_mesh, mesh_ranks
from .models import TransformerBlock
from .pipeline import SCHEDULES, Pipeline, pipeline
from .plans import auto_plan, describe
from .tensor import check_plan, tensor_parallel

__all__ = ["DIMS", "MeshLayout", "Pipeline", "SCHEDULES", "Timeline", "TransformerBlock",
           "auto_plan", "check_plan", "describe", "device_mesh", "factorizations", "mesh_ranks",
           "pipeline", "tensor_parallel"]
