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
    deepspeed_zero1    DeepSpeed ZeRO stage 1 (optimizer state)                 ZeRO-1
    deepspeed_zero2    DeepSpeed ZeRO stage 2 (grads + optimizer state)         ZeRO-2
    deepspeed_zero3    DeepSpeed ZeRO stage 3 (params, grads, state)            ZeRO-3
    tp                 tensor parallel over all ranks (nbdist.parallel plans)   ZeRO-3 (N = tp)
    fsdp2+tp           2-D: FSDP2 over dp x tensor parallel over tp             ZeRO-3 (N = dp x tp)
    hsdp               FSDP2 hybrid: replicas of dp_shard-sized sharded groups  ZeRO-3 (N = dp_shard)
    pp                 pipeline stages: for memory.measure; train with nbdist.parallel.pipeline

``optimizer_fn`` builds the optimizer from parameters: an optimizer class (``torch.optim.Adam``), a
``functools.partial(torch.optim.AdamW, lr=1e-3)`` or any ``params -> Optimizer`` callable. Extra
``**options`` go to the strategy's main torch/fairscale object (named in each description).
``precision="bf16-mixed"`` uses the strategy's own bf16 mixed precision (FSDP1, FSDP2, fairscale
FSDP); strategies without one refuse it -- use ``torch.autocast`` in the step instead.

FSDP1 and FSDP2 make each module that owns parameters its own FSDP unit (then the root), so one
layer at a time is unsharded; pass ``auto_wrap_policy=`` (FSDP1) to choose otherwise.

The DeepSpeed strategies return ``(engine, optimizer)``: options go into the DeepSpeed config
(nested dicts merge), ``precision="bf16-mixed"`` is DeepSpeed's bf16; see
:mod:`nbdist.strategies.deepspeed` for the notebook defaults and what nbdist does around
``deepspeed.initialize`` (DeepSpeed is an optional extra: ``pip install nbdist[deepspeed]``).

The mesh strategies ``tp``, ``fsdp2+tp`` and ``hsdp`` (:mod:`nbdist.strategies.meshed`) build a
named device mesh and tensor-parallel plans with :mod:`nbdist.parallel`: options ``tp=``,
``plan=``, ``sequence_parallel=``, ``dp_shard=``; an unknown option is refused by name.
:func:`mesh_sizes` says which mesh a strategy builds on a world size (``None`` for the others).

fairscale is an optional extra (``pip install nbdist[fairscale]``) and unmaintained upstream: its
strategies are the legacy path, kept to compare with and to run older code; prefer the torch ones.
Register your own with :func:`register_strategy`.
"""
from __future__ import annotations

from . import deepspeed, fairscale, meshed, native, registry
from .deepspeed import DEEPSPEED_HINT, DeepSpeedOptimizer
from .fairscale import FAIRSCALE_HINT
from .meshed import mesh_sizes
from .native import full_parameters
from .registry import (PRECISIONS, Strategy, available_strategies, default_device, get_strategy,
                       register_strategy, wrap)

__all__ = ["DEEPSPEED_HINT", "DeepSpeedOptimizer", "FAIRSCALE_HINT", "PRECISIONS", "Strategy", "available_strategies", "default_device",
           "full_parameters", "get_strategy", "mesh_sizes", "register_strategy", "wrap"]

register_strategy("ddp", native._wrap_ddp, "torch DistributedDataParallel, gradient_as_bucket_view=True; "
                  "all replicated (options -> DDP)", 0)
register_strategy("zero1", native._wrap_zero1, "DDP + torch ZeroRedundancyOptimizer: optimizer state "
                  "sharded (options -> ZeroRedundancyOptimizer)", 1)
register_strategy("fsdp_grad_op", native._wrap_fsdp_grad_op, "torch FSDP1 SHARD_GRAD_OP ~ ZeRO-2: grads "
                  "and state sharded, params unsharded from forward to backward (options -> FSDP)",
                  2, mixed_precision=True)
register_strategy("fsdp", native._wrap_fsdp, "torch FSDP1 FULL_SHARD ~ ZeRO-3: params, grads and state "
                  "sharded (options -> FSDP)", 3, mixed_precision=True)
register_strategy("fsdp2", native._wrap_fsdp2, "torch FSDP2 fully_shard per module ~ ZeRO-3, DTensor "
                  "parameters (options -> fully_shard)", 3, mixed_precision=True)
register_strategy("fairscale_oss", fairscale._wrap_fairscale_oss, "legacy: DDP + fairscale OSS ~ ZeRO-1 "
                  "(options -> OSS)", 1, legacy=True, check=fairscale.require)
register_strategy("fairscale_sharded", fairscale._wrap_fairscale_sharded, "legacy: fairscale OSS + "
                  "ShardedDataParallel ~ ZeRO-2 (options -> ShardedDataParallel)", 2, legacy=True, check=fairscale.require)
register_strategy("fairscale_fsdp", fairscale._wrap_fairscale_fsdp, "legacy: fairscale "
                  "FullyShardedDataParallel ~ ZeRO-3, CUDA only (options -> its FSDP)", 3,
                  mixed_precision=True, legacy=True, check=fairscale.require)
register_strategy("deepspeed_zero1", deepspeed.wrap_zero1, "DeepSpeed ZeRO stage 1: optimizer "
                  "state partitioned (options -> the DeepSpeed config)", 1, mixed_precision=True,
                  check=deepspeed.require)
register_strategy("deepspeed_zero2", deepspeed.wrap_zero2, "DeepSpeed ZeRO stage 2: grads and "
                  "optimizer state partitioned (options -> the DeepSpeed config)", 2,
                  mixed_precision=True, check=deepspeed.require)
register_strategy("deepspeed_zero3", deepspeed.wrap_zero3, "DeepSpeed ZeRO stage 3: params, grads "
                  "and optimizer state partitioned (options -> the DeepSpeed config)", 3,
                  mixed_precision=True, check=deepspeed.require)
register_strategy("tp", meshed.wrap_tp, "tensor parallel over all ranks: Colwise/Rowwise layer "
                  "pairs from nbdist.parallel.auto_plan or plan= (options: plan, "
                  "sequence_parallel); every rank gets the same batch", 3)
register_strategy("fsdp2+tp", meshed.wrap_fsdp2_tp, "2-D mesh: tensor parallel over tp ranks, FSDP2 "
                  "over dp (options: tp (default 2, the whole world when it is odd), plan, sequence_parallel, fully_shard's)", 3,
                  mixed_precision=True)
register_strategy("hsdp", meshed.wrap_hsdp, "FSDP2 hybrid sharding: parameters sharded in groups of "
                  "dp_shard ranks (default half the world), replicated across them (options: "
                  "dp_shard, fully_shard's)", 3, mixed_precision=True)
register_strategy("pp", registry._wrap_pp, "pipeline parallelism: each rank holds its stage's "
                  "layers (nbdist.memory.measure options: schedule, microbatches; train with "
                  "nbdist.parallel.pipeline)", 0)
