"""DeepSpeed ZeRO stages 1-3 (an optional extra): ``deepspeed_zero1``, ``deepspeed_zero2``, ``deepspeed_zero3``.

The only module of nbdist that imports deepspeed, and only inside its functions: ``import nbdist``
never does. ``wrap("deepspeed_zero3", model, optimizer_fn, **options)`` returns ``(engine,
optimizer)``: DeepSpeed's engine (an ``nn.Module``; ``engine.module`` is your model) and a
:class:`DeepSpeedOptimizer` whose ``step()`` is ``engine.step()``. The usual loop
``opt.zero_grad(); loss = f(engine(x)); loss.backward(); opt.step()`` trains: the engine's forward
hooks the output, so a plain ``loss.backward()`` runs DeepSpeed's backward epilogue (gradient
reduction and partitioning) when the last gradient is ready, as ``engine.backward(loss)`` would.

The DeepSpeed config is built from notebook defaults, then ``**options`` merged in (nested
dicts merge key by key; other values replace)::

    train_micro_batch_size_per_gpu 1, gradient_accumulation_steps 1, steps_per_print off,
    zero_allow_untested_optimizer true (any torch optimizer), bf16.enabled for "bf16-mixed"
    (fp16.enabled is refused on a CPU group on every CPU, see _check_precision),
    zero_optimization: stage 1 | 2 | 3,
        reduce_bucket_size = allgather_bucket_size = max(largest parameter, Ψ/4) elements
            (DeepSpeed's 5e8 default is a ~2 GB buffer per rank whatever the model),
        stage 3: stage3_param_persistence_threshold 0 (small models are partitioned too),
            stage3_prefetch_bucket_size = the bucket, memory_efficient_linear false (DeepSpeed's
            default replaces torch.nn.functional.linear for the whole process, for good).

Three things nbdist does around ``deepspeed.initialize``, each scoped and said here:

* DeepSpeed uses the group's default process group (gloo, nccl or nbdist_shm); it does not start
  its own. Its Linux shared-memory op (``deepspeed_shm_comm``, a C++ JIT build of ~26 s at the
  first use, which fails without a compiler) only serves its inference all-reduce, so nbdist skips
  the build while the engine is created (``build_shm_op`` returns None): nothing is compiled.
* On CPU, ``DS_ACCELERATOR=cpu`` is set while deepspeed is first imported (it picks the
  accelerator at import) so a machine with a GPU still trains on the CPU when told to.
* DeepSpeed 0.19.8 calls torch's deprecated ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
  (a FutureWarning per rank per step); nbdist points its comm backend at ``all_gather_single`` /
  ``reduce_scatter_single``, which the deprecated names call in torch 2.13 anyway.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import imports

DEEPSPEED_HINT = "pip install nbdist[deepspeed]"
# DeepSpeed 0.19.8's setup.py, on win32 only, lists bin/deepspeed.bat among its scripts; the sdist
# lacks it, so pip's build fails there (docs/platforms.md). The wheel built elsewhere installs.
_WINDOWS_HINT = (" On Windows, pip cannot install DeepSpeed 0.19.8 from its sdist (its setup.py "
                 "lists bin/deepspeed.bat, which the sdist lacks): build the wheel on Linux or "
                 "WSL (pip wheel deepspeed==0.19.8 --no-deps) and pip install that "
                 "deepspeed-0.19.8-py3-none-any.whl on Windows.")
_MAX_BUCKET = 500_000_000  # DeepSpeed's own default, in elements


def require(what: str = "the deepspeed_zero* strategies need", instead: str = " The torch "
            "strategies 'zero1', 'fsdp_grad_op' and 'fsdp' shard the same way without it.") -> None:
    """Raise a clear ImportError when DeepSpeed is not installed (without importing it: it picks
    its accelerator at import, see :func:`_import`): "``what`` DeepSpeed ... ``instead``"."""
    try:
        missing = importlib.util.find_spec("deepspeed") is None
    except ValueError:  # sys.modules["deepspeed"] is None: import blocked
        missing = True
    if missing:
        here = _WINDOWS_HINT if sys.platform == "win32" else ""
        raise ImportError(f"{what} DeepSpeed, an optional extra: {DEEPSPEED_HINT} (a pure-Python "
                          f"wheel; nothing is compiled).{here}{instead}")


def merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` updated with ``extra``: dicts merge key by key, any other value replaces."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def bucket_elements(model: nn.Module) -> int:
    """Bucket size in elements: a quarter of the model, at least its largest parameter."""
    sizes = [getattr(p, "ds_numel", p.numel())  # ds_numel: a stage-3 partitioned parameter
             for p in {id(p): p for p in model.parameters()}.values()] or [1]
    return int(min(_MAX_BUCKET, max(max(sizes), math.ceil(sum(sizes) / 4))))


def zero_defaults(stage: int, bucket: int) -> Dict[str, Any]:
    """The notebook's ``zero_optimization`` section: buckets of ``bucket`` elements; stage 3
    partitions every parameter and leaves ``torch.nn.functional.linear`` alone."""
    zero: Dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket,
                            "allgather_bucket_size": bucket}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=bucket,
                    memory_efficient_linear=False)
    return zero


def build_config(stage: int, model: nn.Module, precision: str, options: Dict[str, Any],
                 zero_fields=()) -> Dict[str, Any]:
    """The DeepSpeed config ``wrap`` uses: notebook defaults, then ``options`` merged in.

    ``zero_fields``: the keys ``zero_optimization`` accepts; such a key given at the top level is
    refused with a hint (DeepSpeed would ignore it silently).
    """
    misplaced = sorted(k for k in options if k in set(zero_fields) - {"stage"})
    if misplaced:
        hint = ", ".join(f"{k!r}: ..." for k in misplaced)
        raise ValueError(f"{', '.join(misplaced)} belong(s) in DeepSpeed's zero_optimization "
                         f"section: pass zero_optimization={{{hint}}} to wrap() (at the top level "
                         "DeepSpeed would ignore it)")
    asked = options.get("zero_optimization", {}).get("stage", stage)
    if asked != stage:
        raise ValueError(f"the strategy is DeepSpeed ZeRO stage {stage}, but the options ask for "
                         f"zero_optimization.stage={asked!r}: use the strategy "
                         f"'deepspeed_zero{asked}' instead of setting the stage")
    zero = zero_defaults(stage, bucket_elements(model))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "steps_per_print": sys.maxsize, "zero_allow_untested_optimizer": True,
              "zero_optimization": zero, "bf16": {"enabled": precision == "bf16-mixed"}}
    config = merge(config, options)
    bf16 = bool(config.get("bf16", {}).get("enabled"))
    fp16 = bool(config.get("fp16", {}).get("enabled"))
    if bf16 != (precision == "bf16-mixed") or (fp16 and precision != "fp32") or (fp16 and bf16):
        raise ValueError(f"precision={precision!r} and the options' bf16/fp16 sections disagree: "
                         "say bf16 with precision='bf16-mixed' (not bf16={'enabled': True}); "
                         "fp16 goes with precision='fp32' and fp16={'enabled': True}, and not "
                         "with bf16")
    return config


class DeepSpeedOptimizer(torch.optim.Optimizer):
    """What ``wrap`` returns as the optimizer of a DeepSpeed strategy: ``step()`` is the engine's
    step (optimizer update on this rank's partition, then the all-gather of the parameters).

    ``param_groups`` and ``state`` are those of the torch optimizer you built, which DeepSpeed
    runs on this rank's fp32 partitions (set ``lr`` there, or use a torch LR scheduler).
    ``engine`` is the DeepSpeed engine (also the model ``wrap`` returned).
    """

    def __init__(self, engine) -> None:  # no Optimizer.__init__: DeepSpeed owns the parameters
        self.engine = engine
        self._optimizer_step_pre_hooks: Dict[int, Any] = {}
        self._optimizer_step_post_hooks: Dict[int, Any] = {}

    param_groups = property(lambda self: self.engine.optimizer.param_groups,
                            doc="The param groups of the torch optimizer DeepSpeed runs.")
    state = property(lambda self: self.engine.optimizer.state,
                     doc="The torch optimizer's state (this rank's partition).")
    defaults = property(lambda self: self.engine.optimizer.optimizer.defaults,
                        doc="The torch optimizer's defaults.")

    def step(self, closure=None):
        """``engine.step()``; a closure is refused (DeepSpeed has none)."""
        if closure is not None:
            raise ValueError("DeepSpeed's step takes no closure: compute the loss, call "
                             "loss.backward(), then opt.step()")
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients (and DeepSpeed's partitions of them) before the next backward."""
        self.engine.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """DeepSpeed's optimizer state dict (its partition on this rank)."""
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load what :meth:`state_dict` returned on this rank."""
        self.engine.optimizer.load_state_dict(state_dict)

    def memory_parts(self) -> Dict[str, List[torch.Tensor]]:
        """This rank's DeepSpeed-held tensors by kind, for :mod:`nbdist.memory` (see there)."""
        return memory_parts(self.engine)

    def __repr__(self) -> str:
        return (f"DeepSpeedOptimizer(ZeRO stage {self.engine.zero_optimization_stage()}, "
                f"{type(self.engine.optimizer.optimizer).__name__})")


@contextlib.contextmanager
def _no_shm_op():
    """While DeepSpeed creates its comm backend: no JIT build of its shared-memory op."""
    module = sys.modules["deepspeed.comm.torch"]  # not `import ... as`: that binds torch itself
    saved = module.build_shm_op
    module.build_shm_op = lambda: None
    try:
        yield
    finally:
        module.build_shm_op = saved


def _import(device: torch.device):
    """Import deepspeed with the accelerator that matches ``device`` (it picks one at import)."""
    first = "deepspeed" not in sys.modules
    saved = os.environ.get("DS_ACCELERATOR")
    if first and device.type == "cpu" and saved is None:
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        import deepspeed.comm.torch  # noqa: F401 -- for _no_shm_op
    finally:
        if first and device.type == "cpu" and saved is None:
            os.environ.pop("DS_ACCELERATOR", None)
    picked = get_accelerator().device_name()
    if picked != device.type and imports.listed("deepspeed"):
        raise ValueError(f"DeepSpeed uses the {picked!r} accelerator in this rank, but this run "
                         f"trains on {device.type!r}: NBDIST_PRELOAD lists it, so it was imported "
                         "before this run (by the forkserver or a warm spare, or as the rank "
                         "started), and DeepSpeed picked its accelerator then. Set "
                         f"DS_ACCELERATOR={device.type} in the kernel's environment and restart "
                         "the kernel (the forkserver keeps what it imported), or take deepspeed "
                         "out of NBDIST_PRELOAD")
    if picked != device.type:
        raise ValueError(f"DeepSpeed already uses the {picked!r} accelerator in this rank "
                         f"(it picks one when first imported), but this run trains on "
                         f"{device.type!r}: restart the group (group.restart()) before using "
                         f"another device, or set DS_ACCELERATOR={device.type} in its env")
    return deepspeed


def _check_precision(config: Dict[str, Any], accelerator) -> None:
    """Refuse a half precision that does not train here, before anything runs. fp16 on a CPU is
    refused whatever DeepSpeed's cpu accelerator says (it says "supported" on CPUs with
    avx512_fp16 / AMX-FP16): DeepSpeed's fp16 mode scales the loss, so the usual loop's
    ``loss.backward()`` fails in its backward hook, and its skipped overflow steps are a GPU
    trade-off; bf16 has fp32's range and needs no loss scaling, on every CPU."""
    if config.get("fp16", {}).get("enabled") and accelerator.device_name() == "cpu":
        raise ValueError("fp16={'enabled': True} is refused on a CPU group, whatever fp16 support "
                         "this CPU has: DeepSpeed's fp16 mode is made for GPUs (its loss scaling "
                         "needs engine.backward(loss), not the usual loss.backward()). Use "
                         "precision='bf16-mixed' instead (bf16 keeps fp32's range: no loss "
                         "scaling), or precision='fp32'")
    for key, supported in (("fp16", accelerator.is_fp16_supported()),
                           ("bf16", accelerator.is_bf16_supported())):
        if config.get(key, {}).get("enabled") and not supported:
            other = "precision='bf16-mixed'" if key == "fp16" else "precision='fp32'"
            raise ValueError(f"{key} does not work here: DeepSpeed's {accelerator.device_name()} "
                             f"accelerator has no {key} support. Use {other} instead")


def _cast_inputs(dtype):
    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value

    def hook(module, args, kwargs):
        return cast(args), cast(kwargs)
    return hook


def _wrap(stage: int, model, optimizer_fn, device, precision, **options):
    deepspeed = _import(device)
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = build_config(stage, model, precision, options, DeepSpeedZeroConfig.model_fields)
    _check_precision(config, get_accelerator())
    with engine_setup(device):
        deepspeed.init_distributed(dist_backend=str(dist.get_backend()))
        try:  # DeepSpeed's own checks, before the model is touched
            DeepSpeedConfig(config)
        except (ValueError, AssertionError) as err:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"DeepSpeed refused the configuration built from wrap()'s options: "
                             f"{err}") from None
        engine, _, _, _ = deepspeed.initialize(model=model.to(device),
                                               optimizer=optimizer_fn(model.parameters()),
                                               config=config)
    if config["bf16"].get("enabled"):
        engine.register_forward_pre_hook(_cast_inputs(torch.bfloat16), with_kwargs=True)
    return engine, DeepSpeedOptimizer(engine)


@contextlib.contextmanager
def engine_setup(device):
    """The context nbdist creates DeepSpeed's comm backend and engines in (``wrap`` and
    :mod:`nbdist.lightning`): deepspeed imported for ``device`` (:func:`_import`), no JIT build
    of its shared-memory op, and on the way out its comm backend, once it exists, pointed at
    the non-deprecated collectives. Yields the ``deepspeed`` module."""
    deepspeed = _import(torch.device(device))
    _forget_stale_groups(sys.modules.get("deepspeed.utils.groups"))
    try:
        with _no_shm_op():
            yield deepspeed
    finally:
        _undeprecate(deepspeed.comm.comm.cdb)


def _forget_stale_groups(groups) -> None:
    """DeepSpeed caches the process groups it made (``deepspeed.utils.groups``); once the default
    group was re-formed (``nbdist.lightning.fit(process_group_backend=...)``) torch no longer knows
    them: drop them, and DeepSpeed makes them again from the current default group."""
    world = getattr(groups, "_WORLD_GROUP", None)
    if world is not None and world not in dist.distributed_c10d._world.pg_map:
        for name, value in list(vars(groups).items()):
            if name.isupper() and name.endswith(("_GROUP", "_GROUP_RANKS")):
                setattr(groups, name, {} if isinstance(value, dict) else None)


def _undeprecate(cdb) -> None:
    """Point DeepSpeed's comm backend at the non-deprecated torch collectives (same calls)."""
    if cdb is not None and hasattr(dist, "all_gather_single"):  # reduce_scatter_single: same
        cdb.all_gather_function = dist.all_gather_single
        cdb.reduce_scatter_function = dist.reduce_scatter_single


wrap_zero1 = functools.partial(_wrap, 1)
wrap_zero2 = functools.partial(_wrap, 2)
wrap_zero3 = functools.partial(_wrap, 3)


def is_engine(model) -> bool:
    """Whether ``model`` is a DeepSpeed engine (without importing deepspeed)."""
    return any(c.__module__.startswith("deepspeed.") for c in type(model).__mro__)


def full_parameters(engine) -> Dict[str, torch.Tensor]:
    """The engine's full parameters (stage 3 partitions gathered), by the model's names."""
    params = dict(engine.module.named_parameters())
    with _gathered(engine.module):
        return {n: p.detach().float().cpu().clone() for n, p in params.items()}


def is_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO stage 3 partitioned some of ``module``'s parameters (no deepspeed import)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _gathered(module: nn.Module):
    return (sys.modules["deepspeed"].zero.GatheredParameters(list(module.parameters()))
            if is_partitioned(module) else contextlib.nullcontext())


def full_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` with ZeRO-3 partitions gathered (a collective: every rank calls
    it), as CPU copies; ``get_model_state_dict`` would give stage-3 parameters of shape (0,)."""
    with _gathered(module):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def checkpoint_state_dict(path: str, tag=None) -> Dict[str, torch.Tensor]:
    """The full fp32 weights in a DeepSpeed checkpoint directory (any ZeRO stage, any number of
    ranks), read in this process: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``."""
    require("reading a DeepSpeed checkpoint needs", "")
    _import(torch.device("cpu")) if not torch.cuda.is_available() else None  # quiet on CPU
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as read
    return dict(read(str(path), tag))


def memory_parts(engine) -> Dict[str, List[torch.Tensor]]:
    """This rank's tensors under DeepSpeed: ``params`` (stage 3: the shards), ``grads`` (the
    gradient partitions), ``master`` (the fp32 partition the optimizer updates), ``optimizer``
    (the torch optimizer's state on it) and ``buckets`` (reduce buffers: stage 3 keeps one
    between steps; stages 1-2 allocate theirs during backward only).

    Stages 1-2 free the gradient partitions inside ``step()``: take ``grads`` before it."""
    zero = engine.optimizer
    model_params = list(engine.module.parameters())
    params = [getattr(p, "ds_tensor", p) for p in model_params]
    master = list(getattr(zero, "single_partition_of_fp32_groups", None) or
                  getattr(zero, "fp32_partitioned_groups_flat", None) or [])
    grads = [p.grad for p in model_params + master if p.grad is not None]
    averaged = getattr(zero, "averaged_gradients", None) or {}
    grads += [g for group in averaged.values() for g in (group or []) if g is not None]
    flat = getattr(zero, "grad_partitions_flat_buffer", None)
    grads += [flat] if flat is not None else []
    state = [t for s in zero.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    buckets = [t for b in (getattr(zero, "ipg_buckets", None) or {}).values()
               for t in _tensors(getattr(b, "buffer", None))]  # stage 3 keeps its buffer
    return dict(params=params, grads=grads, master=master, optimizer=state, buckets=buckets)


def _tensors(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
