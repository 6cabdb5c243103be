"""Per-rank memory of sharded training: measured on a group, and estimated with the ZeRO formulas.

:func:`measure` trains a few real steps under each strategy on every rank and returns a
:class:`MemoryReport` of per-rank :class:`MemoryRecord` s. Each figure says how it was obtained:

* ``params`` / ``grads`` / ``optimizer`` -- **exact**: unique storages reachable from the model's
  parameters, their ``.grad`` and the optimizer state (DTensors counted by their local shard), each
  storage once, after the last step (grads, params and state all alive). Under DeepSpeed:
  its parameter shards (stage 3), its gradient partitions (taken just before ``step()``, which
  frees them) and its fp32 master partition, counted with the optimizer state.
* ``other`` -- **exact for what Python sees**: every other tensor storage the process gained
  (gc walk): reduce buckets, unsharded parameters left over... C++-only buffers (DDP's reducer
  copy without ``gradient_as_bucket_view``) are invisible to it; the record's notes say so.
* ``in_flight`` -- the same walk between forward and backward of the last step (FSDP's unsharded
  parameters while they wait for backward).
* ``peak`` -- on CUDA the caching allocator's ``max_memory_allocated`` (exact); on CPU, opt-in with
  ``profile=True`` (the torch profiler slows the step down): Python-visible bytes before the step
  plus the largest rise of CPU allocations during it (approximate).
* ``rss`` -- process RSS after ``malloc_trim`` (approximate; includes torch itself, a few hundred
  MiB): a note under the report's table, not a column, and in the exports per rank.

In the report's table every size is in one binary unit (KiB, MiB), the model state's, notes
included (:mod:`nbdist.memory.notes`); ranks with equal figures share a row (rank ``0-3``); each
note is written once, after the strategies (and ranks) it holds for.

Under ``"pp"`` (pipeline stages, :mod:`nbdist.memory.pipeline`) each rank holds its stage's
layers; its figures are compared with "PP: the stage's layers" (``nbdist.memory.formulas.stage_estimate``).

Under ``"tp"``, ``"fsdp2+tp"`` and ``"hsdp"`` each rank's params, grads and optimizer state are
split into **sharded** and **replicated** local bytes (DTensor shards, :mod:`nbdist.memory.sharding`)
and compared with TP: Ψ_s/tp + Ψ_r, 2-D: Ψ_s/(dp·tp) + Ψ_r/dp, HSDP: Ψ/dp_shard, from the model's
actual split (:func:`mesh_estimate`).

:func:`estimate` gives the analytic figures of the ZeRO paper (Rajbhandari et al., 2020) for any
world size -- how to plan a cluster from a laptop -- and, with ``tp=``/``pp=``, Megatron-LM's
model-parallel share of them; with ``transformer=`` (:class:`Transformer`) the activations per
Korthikanti et al. 2022 (:mod:`nbdist.memory.activations`). This module imports no matplotlib or IPython;
:meth:`MemoryReport.plot` imports :mod:`nbdist.ui.plots.memory` when called.
"""
from __future__ import annotations

from .accounting import human_bytes, unit_for
from .activations import Transformer
from .command import cli
from .formulas import (OPTIMIZERS, Estimate, EstimateCurve, count_params, estimate, estimate_curve,
                       mlp, model_spec, parse_count)
from .report import MemoryRecord, MemoryReport, estimate_table, measure
from .sharding import mesh_estimate

__all__ = ["OPTIMIZERS", "Estimate", "EstimateCurve", "MemoryRecord", "MemoryReport", "Transformer",
           "cli", "count_params", "estimate", "estimate_curve", "estimate_table", "human_bytes",
           "measure", "mesh_estimate", "mlp", "model_spec", "parse_count", "unit_for"]
