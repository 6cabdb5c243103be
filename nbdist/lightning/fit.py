"""``fit``: a Lightning ``Trainer`` run on every rank of a group, results back per rank."""
from __future__ import annotations

import importlib
import sys
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Union

from ..runtime.ranklog import log
from ..strategies import deepspeed as core
from .deepspeed import fp16_message, is_fp16
from .guards import _SPAWNING, _dist, _installed_namespace, _spawn_message, install_hooks

_WEIGHTS = ("rank0", "all", "none")


# ---- fit ---------------------------------------------------------------------------------------
@dataclass
class FitResult:
    """What :func:`fit` returns for one rank."""

    rank: int
    metrics: Dict[str, float]  #: ``trainer.callback_metrics`` as floats
    checkpoint_path: Optional[str]  #: the checkpoint ModelCheckpoint kept (``None``: none)
    epochs: int  #: epochs run
    global_step: int  #: optimizer steps run
    backend: str  #: the process group's backend during the fit
    state_dict: Optional[Dict[str, Any]] = field(default=None, repr=False)  #: full CPU weights

    def load_into(self, module, strict: bool = True):
        """Load the trained weights into ``module`` (e.g. a fresh one made in the kernel)."""
        if self.state_dict is None:
            raise ValueError(f"rank {self.rank} returned no weights: with weights='rank0' (the "
                             "default) only rank 0 does, and with weights='none' no rank does. "
                             "Use results[0].load_into(module), or fit(..., weights='all').")
        module.load_state_dict(self.state_dict, strict=strict)
        return module


def fit(group, make_module: Callable, make_data: Optional[Callable] = None,
        strategy: Union[str, Any] = "ddp", process_group_backend: Optional[str] = None, *,
        weights: str = "rank0", timeout: Optional[float] = None, block: bool = True,
        **trainer_kwargs):
    """Train with a Lightning ``Trainer`` on every rank of ``group``; return a :class:`FitResult`
    per rank (metrics, checkpoint path, and the trained weights for ``FitResult.load_into``).

    Args:
        group: an :class:`nbdist.Group`.
        make_module: called on each rank; returns the ``LightningModule``.
        make_data: called on each rank; returns a ``LightningDataModule``, a training
            ``DataLoader``, or ``(train_loader, val_loader)``. ``None``: the module has its own.
        strategy: a Lightning strategy name or object. ``"fsdp2"`` means FSDP2 through
            ``ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)`` (the
            module applies ``fully_shard`` in ``configure_model``, over
            ``self.device_mesh["data_parallel"]``); it also works on CPU, where ``"fsdp"`` does not.
            ``"tp"`` and ``"fsdp2+tp"`` are the same strategy with ``tensor_parallel_size`` the
            world / ``strategies.mesh_sizes("fsdp2+tp", world)["tp"]``: the module applies
            ``nbdist.parallel.tensor_parallel(self, self.device_mesh["tensor_parallel"])`` (and
            ``fully_shard`` over ``"data_parallel"``) in ``configure_model``. ``"hsdp"`` and
            ``"pp"`` are refused (``ValueError``): Lightning's mesh is data x tensor parallel only;
            train them with ``strategies.wrap("hsdp", ...)`` / ``nbdist.parallel.pipeline`` in
            ``%%dist`` instead.
            ``"deepspeed_stage_1"``, ``"_2"``, ``"_3"`` (or a ``DeepSpeedStrategy`` object) train
            on CPU groups too, through :class:`NbdistDeepSpeedStrategy` (needs DeepSpeed:
            ``pip install nbdist[deepspeed]``); under stage 3 the returned weights are gathered
            whole, and :func:`load_zero_checkpoint` reads the checkpoint directory in the kernel.
        process_group_backend: default: the group's backend. Another one (a registered custom
            backend, ``"cpu:gloo,cuda:nccl"``, ...) is used for this fit: the ranks re-form their
            process group with it, then go back to the group's backend (per-rank variables stay).
        weights: which ranks return the full trained weights: ``"rank0"``, ``"all"`` or ``"none"``.
        timeout: deadline for the whole fit, in seconds (default: the group's ``call_timeout``).
        block: ``False`` returns an :class:`nbdist.Job` at once (``job.result()`` gives the
            results); what the module logs with ``self.log`` reaches ``job.metrics`` as it trains.
        **trainer_kwargs: passed to ``Trainer``. Defaults: ``accelerator`` from the group's
            device, ``devices=group.world_size``; ranks other than 0 show no progress bar or
            model summary.
    """
    from ..backends import resolve_backend

    built = not isinstance(make_module, type) and hasattr(make_module, "training_step")
    if built or not callable(make_module) or (make_data is not None and not callable(make_data)):
        raise TypeError("make_module (and make_data, when given) must be callables that build the "
                        "LightningModule / the data on each rank, e.g. fit(group, MyModule, MyData)"
                        f", not {type(make_module).__name__} / {type(make_data).__name__} objects")
    if weights not in _WEIGHTS:
        raise ValueError(f"weights must be one of {list(_WEIGHTS)}, got {weights!r}")
    world = group.world_size
    if isinstance(strategy, str):
        name = strategy.lower()
        if any(word in name for word in _SPAWNING):
            raise ValueError(_spawn_message(f"strategy={strategy!r}", world))
        if name in _NOT_IN_LIGHTNING:
            raise ValueError(_NOT_IN_LIGHTNING[name].format(strategy=strategy))
        if name.startswith("fsdp") and name not in _MODEL_PARALLEL and group.device == "cpu":
            raise ValueError(f"strategy={strategy!r} is Lightning's FSDPStrategy, which needs "
                             "CUDA; this group runs on CPU. Use strategy='fsdp2' (FSDP2 through "
                             "ModelParallelStrategy: apply fully_shard in configure_model).")
    else:
        own = getattr(strategy, "_process_group_backend", None)
        if own and process_group_backend and own.lower() != process_group_backend.lower():
            raise ValueError(f"the strategy object says process_group_backend={own!r} but fit() "
                             f"got process_group_backend={process_group_backend!r}; give one.")
        process_group_backend = process_group_backend or own
    if _is_deepspeed(strategy):
        core.require(f"strategy={strategy!r} needs" if isinstance(strategy, str) else
                     "DeepSpeedStrategy needs", " Without it, strategy='fsdp2' shards like "
                     "ZeRO-3 (on CPU too).")
        if group.device == "cpu" and is_fp16(trainer_kwargs.get("precision")):
            raise ValueError(fp16_message(trainer_kwargs["precision"]))
    target = group.backend
    custom: tuple = ()
    if process_group_backend is not None:
        choice = resolve_backend(process_group_backend, group.device)  # BackendError if unusable
        target, custom = choice.backend, choice.custom
    if target != group.backend:
        print(f"nbdist: this fit uses process_group_backend={target!r}, the group uses "
              f"{group.backend!r}: the ranks re-form their process group with {target!r} for the "
              f"fit and go back to {group.backend!r} afterwards (per-rank variables are kept).",
              file=sys.stdout)  # a note, not an error: stderr shows as one in Jupyter
    spec = {"strategy": strategy, "backend": target, "home": group.backend, "custom": custom,
            "device": group.device, "timeout": group.timeout, "weights": weights,
            "fit": uuid.uuid4().hex}  # names the store prefixes of this fit's re-forms
    if not block:
        return group.submit(_fit_on_rank, make_module, make_data, spec, trainer_kwargs,
                            timeout=timeout)
    return group.call(_fit_on_rank, (make_module, make_data, spec, trainer_kwargs),
                      timeout=timeout)


def _is_deepspeed(strategy) -> bool:
    if isinstance(strategy, str):
        return strategy.lower().startswith("deepspeed")
    return any(c.__name__ == "DeepSpeedStrategy" for c in type(strategy).__mro__)


def _rendezvous() -> tuple:
    """The default group's own store (under its prefixes), rank and world size: what each re-form
    uses, taken before the first (a re-form that failed leaves no default group to ask)."""
    dist = _dist()
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store, dist.get_rank(), dist.get_world_size()


def _reform(backend: str, timeout: float, where: tuple, name: str,
            wait: Optional[float] = None) -> None:
    """Replace the default process group (if any) by one with ``backend`` over ``where``
    (:func:`_rendezvous`), waiting up to ``wait`` s (default ``timeout``) for every rank to join;
    collectives then time out after ``timeout``. ``name``: the same on every rank and new for each
    re-form (the fit's id and the step), so the ranks meet under one fresh store prefix."""
    dist = _dist()
    from torch.distributed import distributed_c10d as c10d

    store, rank, size = where
    # The prefix is named by the kernel, not counted on the ranks: a counter shared in the store
    # let a rank whose fit backend refused at once count its way home before a slower rank counted
    # its way into the fit, and the two then waited under different prefixes until their timeouts.
    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.PrefixStore(f"nbdist-lightning/{name}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=wait or timeout))
    if wait and wait != timeout:
        c10d._set_pg_timeout(timedelta(seconds=timeout))


def _home(spec, where: tuple) -> None:
    """Back to the group's backend after a fit. A rank that failed early (its fit backend refused
    to start, or its training raised) waits here for the others, which give up on the fit's
    process group within its timeout: hence the longer wait to join."""
    _reform(spec["home"], spec["timeout"], where, f"{spec['fit']}/home",
            wait=2 * spec["timeout"] + 10)


_MODEL_PARALLEL = ("fsdp2", "tp", "fsdp2+tp")  # nbdist's names served by ModelParallelStrategy
_LIGHTNING_MESH = ("Lightning's ModelParallelStrategy builds a data_parallel x tensor_parallel mesh "
                   "only; through fit() nbdist offers strategy='fsdp2', 'tp' and 'fsdp2+tp' on it")
#: nbdist strategy names that Lightning cannot run, refused by fit() before anything runs
_NOT_IN_LIGHTNING = {
    "hsdp": "strategy={strategy!r} (FSDP2 on a dp_replicate x dp_shard mesh) does not train "
            f"through Lightning: {_LIGHTNING_MESH}. Train HSDP without Lightning: "
            "model, opt = nbdist.strategies.wrap('hsdp', model, make_optimizer) in a %%dist cell "
            "(or group.run(fn)), or use strategy='fsdp2' or 'fsdp2+tp' here.",
    "pp": "strategy={strategy!r} (pipeline parallelism) does not train through Lightning: "
          f"Lightning has no pipeline strategy ({_LIGHTNING_MESH}). Train a pipeline without "
          "Lightning: pipe = nbdist.parallel.pipeline(model, '1f1b', microbatches, loss_fn=...) "
          "and pipe.step(x, y) in a %%dist cell (or group.run(fn)), or use strategy='tp' or "
          "'fsdp2+tp' here.",
}


def _build_strategy(pl, strategy, backend: str, world_size: int):
    if not isinstance(strategy, str):
        return strategy
    name, strategies = strategy.lower(), pl.strategies
    if name == "ddp":
        return strategies.DDPStrategy(process_group_backend=backend)
    if name in _MODEL_PARALLEL:  # Lightning's 2-D strategy; configure_model applies TP / FSDP2
        from ..strategies import mesh_sizes

        tp = {"fsdp2": 1, "tp": world_size}.get(name) or mesh_sizes(name, world_size)["tp"]
        return strategies.ModelParallelStrategy(data_parallel_size=world_size // tp,
                                                tensor_parallel_size=tp,
                                                process_group_backend=backend)
    if name == "fsdp":
        return strategies.FSDPStrategy(process_group_backend=backend)
    return strategy


def forwarder(pl):
    """A Lightning callback that sends the scalars the module logs (``self.log``) to the kernel
    with ``nbdist.log``, at the global step, after every training batch and validation epoch."""
    class NbdistMetrics(pl.Callback):
        """Forwards ``trainer.callback_metrics`` to ``nbdist.log``."""

        def _forward(self, trainer) -> None:
            scalars = {k: float(v) for k, v in trainer.callback_metrics.items()
                       if getattr(v, "numel", lambda: 1)() == 1}
            if scalars:
                log(step=trainer.global_step, **scalars)

        def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
            self._forward(trainer)

        def on_validation_epoch_end(self, trainer, *args, **kwargs) -> None:
            self._forward(trainer)

    return NbdistMetrics()


def _fit_on_rank(make_module, make_data, spec, trainer_kwargs) -> FitResult:
    dist = _dist()
    install_hooks()
    switch = spec["backend"] != spec["home"]
    if switch:
        for backend in spec["custom"]:
            backend.register_in_torch()
        where = _rendezvous()
        try:
            _reform(spec["backend"], spec["timeout"], where, f"{spec['fit']}/fit")
        except BaseException:
            _home(spec, where)  # every rank comes here: the group keeps a process group
            raise
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        module = make_module()
        data = make_data() if make_data is not None else None
        pl = importlib.import_module(_installed_namespace(module))
        kwargs = dict(trainer_kwargs)
        kwargs.setdefault("accelerator", "gpu" if spec["device"] == "cuda" else "cpu")
        kwargs.setdefault("devices", world)
        if rank != 0:
            kwargs.update(enable_progress_bar=False, enable_model_summary=False)
        kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [forwarder(pl)]
        trainer = pl.Trainer(strategy=_build_strategy(pl, spec["strategy"], spec["backend"], world),
                             **kwargs)
        if isinstance(data, pl.LightningDataModule):
            trainer.fit(module, datamodule=data)
        elif isinstance(data, tuple):
            trainer.fit(module, *data)
        else:
            trainer.fit(module, data)
        state = None
        if spec["weights"] != "none":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 get_model_state_dict)

            if core.is_partitioned(module):  # ZeRO-3: get_model_state_dict would give (0,)
                full = core.full_state_dict(module)
            else:
                full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
            if spec["weights"] == "all" or rank == 0:
                state = {k: v.detach().cpu().clone() for k, v in full.items()}
        callback = trainer.checkpoint_callback
        path = callback.best_model_path or callback.last_model_path if callback else None
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if getattr(v, "numel", lambda: 1)() == 1}
        return FitResult(rank, metrics, path or None, trainer.current_epoch, trainer.global_step,
                         str(dist.get_backend()), state)
    finally:
        if switch:
            _home(spec, where)
