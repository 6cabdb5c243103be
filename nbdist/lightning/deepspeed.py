"""DeepSpeed through Lightning on nbdist's ranks, CPU included: ``NbdistDeepSpeedStrategy``.

Lightning 2.6's ``DeepSpeedStrategy`` refuses the CPU three times: ``setup_environment`` ("only
supported on CUDA GPUs"), ``_validate_device_index_selection`` (CPU devices have no index) and
``deepspeed.initialize(args=Namespace(device_rank=root_device.index))`` (``None`` on the CPU).
DeepSpeed itself trains ZeRO 1-3 on the CPU over gloo. ``NbdistDeepSpeedStrategy`` is Lightning's
class with those three places made CPU-capable (on CUDA they are Lightning's own), plus what
:mod:`nbdist.strategies.deepspeed` does around DeepSpeed everywhere:

* it uses the group's existing process group (gloo, nccl or nbdist_shm), with no JIT build of
  DeepSpeed's shared-memory op and torch's non-deprecated collectives;
* the notebook defaults of ``zero_optimization``: buckets of a quarter of the model (at least its
  largest parameter) instead of Lightning's 2e8 elements (800 MB per buffer), and under stage 3
  every parameter partitioned (``stage3_param_persistence_threshold`` 0). A value you set (in
  ``config`` or as an argument other than Lightning's default) wins;
* fp16 (``precision="16-mixed"``) is refused on the CPU before anything runs: DeepSpeed's fp16
  mode is a GPU one. ``"bf16-mixed"`` and ``"32-true"`` work.

On a rank prepared by nbdist (:func:`nbdist.lightning.prepare`, :func:`nbdist.lightning.fit`),
``Trainer(strategy="deepspeed_stage_3")`` and Lightning's own ``DeepSpeedStrategy`` objects
become this class by themselves. DeepSpeed is imported only through
:mod:`nbdist.strategies.deepspeed` (and by Lightning).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Dict

import torch

from ..strategies import deepspeed as core

_LIGHTNING_BUCKET = 200_000_000  # Lightning's default reduce/allgather bucket, in elements
_UNBUILT_BUCKET = 1 << 24  # the module has no parameters yet (built in configure_model)
_FP16 = ("16", "16-mixed", "16-true")
_classes: Dict[str, type] = {}


def fp16_message(precision: Any) -> str:
    return (f"precision={precision!r} with DeepSpeed does not work on the CPU: DeepSpeed's fp16 "
            "mode (loss scaling, fp16 optimizer) is made for GPUs. Use precision='bf16-mixed' "
            "(or '32-true') on a CPU group.")


def is_fp16(precision: Any) -> bool:
    """Whether a Trainer ``precision`` value is fp16."""
    return str(precision) in _FP16


def _guess_device() -> str:
    """The device DeepSpeed should pick when a strategy is built: CPU unless the rank has a GPU
    and a process group that is not CPU-only."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "cpu"
    if dist.is_available() and dist.is_initialized():
        return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return "cuda"


class _Methods:
    """Lightning's ``DeepSpeedStrategy`` made CPU-capable, on nbdist's process group with the
    notebook defaults (see :mod:`nbdist.lightning.deepspeed`). Takes the same arguments."""

    # Copied into a direct subclass of Lightning's class (strategy_class), so that a Lightning
    # DeepSpeedStrategy object can become one (adopt: same layout); hence _up() for the parent.
    def _up(self):
        own = next(c for c in type(self).__mro__ if c in _classes.values())
        return super(own, self)

    def __init__(self, *args, **kwargs) -> None:
        # Lightning imports deepspeed here, which picks its accelerator at its first import.
        accelerator = kwargs.get("accelerator", args[0] if args else None)
        device = accelerator if isinstance(accelerator, str) else _guess_device()
        with core.engine_setup("cpu" if device == "cpu" else "cuda"):
            pass  # only the import, with the accelerator of the device
        self._up().__init__(*args, **kwargs)

    def _on_cpu(self) -> bool:
        return self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if not self._on_cpu():
            return self._up().setup_environment()
        precision = self.precision_plugin.precision
        if is_fp16(precision):
            raise ValueError(fp16_message(precision))
        with core.engine_setup(self.root_device):  # checks DeepSpeed's accelerator is the CPU
            pass
        ddp = _lightning(type(self), "ddp").DDPStrategy
        return ddp.setup_environment(self)  # skip the "only on CUDA GPUs" check

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            return self._up().setup_distributed()
        _lightning(type(self), "deepspeed").reset_seed()  # Lightning's, minus the index check
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _init_deepspeed_distributed(self) -> None:
        with core.engine_setup(self.root_device):
            self._up()._init_deepspeed_distributed()

    def _get_process_group_backend(self) -> str:
        import torch.distributed as dist

        if dist.is_initialized():  # the group's own, which DeepSpeed reuses
            return str(dist.get_backend())
        return self._up()._get_process_group_backend()

    def _device_rank(self) -> int:
        index = self.root_device.index
        return self.local_rank if index is None else index

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        with core.engine_setup(self.root_device) as deepspeed:
            engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()), config=self.config,
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
        return engine, deepspeed_optimizer

    def _initialize_deepspeed_inference(self, model) -> None:
        # Lightning's, with the device rank above.
        config: Dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage_3:
            config.update(zero_allow_untested_optimizer=self.config["zero_allow_untested_optimizer"],
                          zero_optimization=self.config["zero_optimization"])
        _lightning(type(self), "deepspeed").remove_module_hooks(model)
        with core.engine_setup(self.root_device) as deepspeed:
            self.model, _, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self._device_rank()), config=config,
                model=model, optimizer=None, lr_scheduler=None, model_parameters=[],
                dist_init_required=False)

    def _format_config(self) -> None:
        self._up()._format_config()
        zero = self.config.get("zero_optimization")
        if not isinstance(zero, dict) or self.lightning_module is None:
            return
        unbuilt = not any(True for _ in self.lightning_module.parameters())
        bucket = _UNBUILT_BUCKET if unbuilt else core.bucket_elements(self.lightning_module)
        for key, value in core.zero_defaults(int(zero.get("stage", 0)), bucket).items():
            if key.endswith("bucket_size") and zero.get(key) == _LIGHTNING_BUCKET:
                zero[key] = value  # Lightning's default, not a choice: the notebook's
            else:
                zero.setdefault(key, value)



def _base_namespace(cls: type) -> str:
    """The Lightning distribution ``cls`` subclasses a strategy of."""
    for base in cls.__mro__:
        for pl in ("pytorch_lightning", "lightning.pytorch"):  # the two distributions
            if base.__module__.startswith(pl + "."):
                return pl
    return "pytorch_lightning"


def _lightning(cls: type, strategy_module: str):
    return importlib.import_module(f"{_base_namespace(cls)}.strategies.{strategy_module}")


def strategy_class(pl: str) -> type:
    """``NbdistDeepSpeedStrategy`` for one Lightning distribution (``pytorch_lightning`` or
    ``lightning.pytorch``): a subclass of its ``DeepSpeedStrategy``."""
    if pl not in _classes:
        base = importlib.import_module(pl + ".strategies.deepspeed").DeepSpeedStrategy
        body = {k: v for k, v in vars(_Methods).items() if k not in ("__dict__", "__weakref__")}
        body.update(__module__="nbdist.lightning", __qualname__="NbdistDeepSpeedStrategy")
        _classes[pl] = type("NbdistDeepSpeedStrategy", (base,), body)
    return _classes[pl]


def adopt(pl: str, strategy: Any) -> Any:
    """Lightning's own ``DeepSpeedStrategy`` object becomes an ``NbdistDeepSpeedStrategy`` (same
    state: the subclass adds methods only); anything else is returned as it is."""
    module = sys.modules.get(pl + ".strategies.deepspeed")
    if module is not None and type(strategy) is module.DeepSpeedStrategy:
        strategy.__class__ = strategy_class(pl)
    return strategy


def register(pl: str) -> None:
    """Point Lightning's ``deepspeed*`` strategy names at ``NbdistDeepSpeedStrategy`` (on a rank)."""
    registry = importlib.import_module(pl + ".strategies").StrategyRegistry
    base = importlib.import_module(pl + ".strategies.deepspeed").DeepSpeedStrategy
    for entry in registry.values():
        if entry.get("strategy") is base:
            entry["strategy"] = strategy_class(pl)


def load_zero_checkpoint(path, tag=None) -> Dict[str, torch.Tensor]:
    """The full fp32 weights in a checkpoint that Lightning's DeepSpeed strategy wrote (a
    directory, ``FitResult.checkpoint_path``; under stage 3 each rank wrote its shard there), read
    here in the kernel, with no group: ``module.load_state_dict(load_zero_checkpoint(path))``.

    DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``, with the keys of the
    ``LightningModule``'s own ``state_dict``. Lightning's
    ``convert_zero_checkpoint_to_fp32_state_dict(path, file)`` writes a single file instead, for
    ``LightningModule.load_from_checkpoint``.
    """
    prefix = "_forward_module."  # checkpoints of Lightning < 2.1
    return {k[len(prefix):] if k.startswith(prefix) else k: v
            for k, v in core.checkpoint_state_dict(path, tag).items()}
