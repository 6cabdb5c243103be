"""Lightning inside nbdist's ranks: a plain ``Trainer`` in ``%%dist`` cells, or :func:`fit`.

Lightning's notebook path (``ddp_notebook``) forks the kernel; nbdist runs the ``Trainer`` in its
ranks, where torch.distributed is initialised and ``LOCAL_RANK`` & co. are set, so Lightning reuses
the group and starts no process. :func:`install_hooks` (run on the ranks by :func:`fit` and
:func:`prepare`) patches Lightning as soon as it is imported there, so that a plain ``Trainer``:

* uses :class:`NbdistEnvironment` unless given a cluster environment: ranks and world size come
  from torch.distributed, ``WORLD_SIZE`` survives ``fit``, and ``devices x num_nodes`` other than
  the group's world size is an error at ``Trainer(...)``, not a silent partial split of the data;
* refuses spawning strategies (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``) and child scripts;
* refuses a ``process_group_backend`` other than the group's, which Lightning would silently
  ignore; :func:`fit` honours it instead, re-forming the process group for the fit.

``import nbdist`` never imports Lightning; this module imports it only when used.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Union

# Lightning ships twice: the ``pytorch_lightning`` package and the unified ``lightning`` package.
_FABRIC_OF = {"pytorch_lightning": "lightning_fabric", "lightning.pytorch": "lightning.fabric"}
_SPAWNING = ("spawn", "fork", "notebook")
_WEIGHTS = ("rank0", "all", "none")
_patched: set = set()
_env_classes: Dict[str, type] = {}

__all__ = ["FitResult", "NbdistEnvironment", "fit", "install_hooks", "prepare"]


# ---- messages (each one is produced by a test) -------------------------------------------------
def _spawn_message(what: str, world_size: int) -> str:
    return (f"Lightning tried to start its own worker processes ({what}), but this code already "
            f"runs on the {world_size} ranks of an nbdist group: the ranks are the processes. Use "
            f"strategy='ddp' (or 'fsdp2', 'fsdp', ...; no spawning strategy) with "
            f"devices={world_size}.")


def _size_message(size: int, world_size: int) -> str:
    harm = (f"Lightning would split the data {size} ways and silently skip part of it" if
            size > world_size else "the ranks would not train as one job")
    return (f"the Trainer is set up for {size} process{'es' if size != 1 else ''} (devices x "
            f"num_nodes) but this nbdist group has {world_size} ranks: {harm}. Use "
            f"devices={world_size}, num_nodes=1, or restart the group with world_size={size}.")


def _backend_message(asked: str, current: str) -> str:
    return (f"the strategy asks for process_group_backend={asked!r}, but this rank's process group "
            f"(set up by nbdist) uses {current!r}, and Lightning reuses an existing group as is: "
            f"{asked!r} would be silently ignored. Use nbdist.lightning.fit(group, ..., "
            f"process_group_backend={asked!r}), which re-forms the process group for the fit, or "
            f"group.restart(backend={asked!r}).")


# ---- the cluster environment -------------------------------------------------------------------
def _dist():
    import torch.distributed as dist

    return dist


def _in_group() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


class _EnvironmentMethods:
    """Lightning cluster environment for nbdist ranks.

    The processes already exist and torch.distributed is initialised: ranks and world size come
    from ``torch.distributed``; Lightning never launches processes; a Trainer whose
    ``devices x num_nodes`` is not the group's world size is a ``ValueError``; ``teardown`` leaves
    the environment (``WORLD_SIZE``) alone. Pass it as ``Trainer(plugins=[NbdistEnvironment()])``;
    on a rank prepared by nbdist a plain ``Trainer`` uses it by itself.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """Always ``True``: nbdist started the processes."""
        return True

    @property
    def main_address(self) -> str:
        """The rendezvous host (unused: the process group exists already)."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """The rendezvous port (unused: the process group exists already)."""
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """True where torch.distributed is initialised (as on every nbdist rank)."""
        return _in_group()

    def world_size(self) -> int:
        """The process group's size."""
        return _dist().get_world_size()

    def set_world_size(self, size: int) -> None:
        """Check Lightning's world size (``devices x num_nodes``) against the group's."""
        if size != self.world_size():
            raise ValueError(_size_message(size, self.world_size()))

    def global_rank(self) -> int:
        """This process's rank in the process group."""
        return _dist().get_rank()

    def set_global_rank(self, rank: int) -> None:
        """Nothing to do: the rank is the process group's."""

    def local_rank(self) -> int:
        """The rank on this host (``LOCAL_RANK``, set by nbdist)."""
        return int(os.environ.get("LOCAL_RANK", self.global_rank()))

    def node_rank(self) -> int:
        """The host's index (``NODE_RANK``, 0 for a local group)."""
        return int(os.environ.get("NODE_RANK", "0"))

    def teardown(self) -> None:
        """Leave the environment as it is (Lightning's default deletes ``WORLD_SIZE``)."""


def _environment_class(fabric: str) -> type:
    """``NbdistEnvironment`` for one Lightning distribution (its ``ClusterEnvironment`` base)."""
    if fabric not in _env_classes:
        base = importlib.import_module(fabric + ".plugins.environments").ClusterEnvironment
        body = {"__doc__": _EnvironmentMethods.__doc__, "__module__": __name__}
        _env_classes[fabric] = type("NbdistEnvironment", (_EnvironmentMethods, base), body)
    return _env_classes[fabric]


def __getattr__(name: str):
    # NbdistEnvironment subclasses Lightning's ClusterEnvironment, so it is built on first use.
    if name == "NbdistEnvironment":
        return _environment_class(_FABRIC_OF[_installed_namespace()])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _installed_namespace(module: Any = None) -> str:
    """The Lightning package to use: the one ``module`` comes from, else one imported/installed."""
    if module is not None:
        for cls in type(module).__mro__:
            if cls.__module__.startswith("lightning.pytorch"):
                return "lightning.pytorch"
    for pl in _FABRIC_OF:
        if pl in sys.modules:
            return pl
    if importlib.util.find_spec("pytorch_lightning") is None and \
            importlib.util.find_spec("lightning") is not None:
        return "lightning.pytorch"
    return "pytorch_lightning"


# ---- guards installed on the ranks -------------------------------------------------------------
class _ImportHook(importlib.abc.MetaPathFinder):
    """Patches Lightning right after ``pytorch_lightning`` / ``lightning.pytorch`` is imported."""

    def find_spec(self, name, path=None, target=None):
        if name not in _FABRIC_OF or name in _patched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        original = getattr(spec.loader, "exec_module", None)
        if original is None:
            return spec

        def exec_module(module):
            original(module)
            _patch(name)

        spec.loader.exec_module = exec_module
        return spec


def install_hooks() -> None:
    """On a rank: make Lightning's ``Trainer`` safe to use there (see the module docstring).

    Patches Lightning at once if it is imported already, else as soon as it is. Idempotent.
    """
    if not any(isinstance(f, _ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportHook())
    for pl in _FABRIC_OF:
        if pl in sys.modules:
            _patch(pl)


def prepare(group) -> None:
    """Install nbdist's Lightning guards on every rank of ``group`` (:func:`fit` does it itself).

    Run it once per group before a plain ``Trainer`` in ``%%dist`` cells / ``group.exec``.
    """
    group.run(install_hooks)


def _backend_key(name: str) -> str:
    from torch.distributed import distributed_c10d as c10d

    try:
        return str(c10d.BackendConfig(c10d.Backend(name)))
    except (ValueError, RuntimeError):  # a name torch does not know in this process
        return name.lower()


def _patch(pl: str) -> None:
    if pl in _patched:
        return
    _patched.add(pl)
    connector = importlib.import_module(pl + ".trainer.connectors.accelerator_connector")
    spawning = importlib.import_module(pl + ".strategies.launchers.multiprocessing")
    parallel = importlib.import_module(pl + ".strategies").ParallelStrategy
    script = importlib.import_module(pl + ".strategies.launchers.subprocess_script")
    env_cls = _environment_class(_FABRIC_OF[pl])
    cls = connector._AcceleratorConnector
    choose, lazy_init = cls._choose_and_init_cluster_environment, cls._lazy_init_strategy

    def _choose_and_init_cluster_environment(self):
        env = choose(self)
        if env is self._cluster_environment_flag or not _in_group():
            return env  # the caller's own plugin wins; outside a group nothing changes
        return env_cls()

    def _lazy_init_strategy(self):
        lazy_init(self)  # sets world ranks (NbdistEnvironment checks the size) and the launcher
        if not _in_group():
            return
        dist = _dist()
        if not isinstance(self.strategy, parallel) and dist.get_world_size() > 1:
            raise ValueError(_size_message(1, dist.get_world_size()))  # e.g. devices=1
        if isinstance(self.strategy.launcher, spawning._MultiProcessingLauncher):
            flag = self._strategy_flag
            what = f"strategy={flag!r}" if isinstance(flag, str) else type(flag).__name__
            raise ValueError(_spawn_message(what, dist.get_world_size()))
        asked = getattr(self.strategy, "_process_group_backend", None)
        if asked and _backend_key(asked) != str(dist.get_backend_config()):
            raise ValueError(_backend_message(asked, str(dist.get_backend())))

    def _call_children_scripts(self, *args, **kwargs):
        raise RuntimeError(_spawn_message(f"{self.num_processes - 1} more copies of this script",
                                          _dist().get_world_size()))

    cls._choose_and_init_cluster_environment = _choose_and_init_cluster_environment
    cls._lazy_init_strategy = _lazy_init_strategy
    script._SubprocessScriptLauncher._call_children_scripts = _call_children_scripts


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
        weights: str = "rank0", timeout: Optional[float] = None,
        **trainer_kwargs) -> List[FitResult]:
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
        process_group_backend: default: the group's backend. Another one (a registered custom
            backend, ``"cpu:gloo,cuda:nccl"``, ...) is used for this fit: the ranks re-form their
            process group with it, then go back to the group's backend (per-rank variables stay).
        weights: which ranks return the full trained weights: ``"rank0"``, ``"all"`` or ``"none"``.
        timeout: deadline for the whole fit, in seconds (default: the group's ``call_timeout``).
        **trainer_kwargs: passed to ``Trainer``. Defaults: ``accelerator`` from the group's
            device, ``devices=group.world_size``; ranks other than 0 show no progress bar or
            model summary.
    """
    from .backends import resolve_backend

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
        if name.startswith("fsdp") and name != "fsdp2" and group.device == "cpu":
            raise ValueError(f"strategy={strategy!r} is Lightning's FSDPStrategy, which needs "
                             "CUDA; this group runs on CPU. Use strategy='fsdp2' (FSDP2 through "
                             "ModelParallelStrategy: apply fully_shard in configure_model).")
        if name.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
            raise ImportError(f"strategy={strategy!r} needs DeepSpeed, which is not installed "
                              "(pip install deepspeed; it needs a CUDA build of torch). On CPU, "
                              "strategy='fsdp2' shards like ZeRO-3.")
    else:
        own = getattr(strategy, "_process_group_backend", None)
        if own and process_group_backend and own.lower() != process_group_backend.lower():
            raise ValueError(f"the strategy object says process_group_backend={own!r} but fit() "
                             f"got process_group_backend={process_group_backend!r}; give one.")
        process_group_backend = process_group_backend or own
    target = group.backend
    custom: tuple = ()
    if process_group_backend is not None:
        choice = resolve_backend(process_group_backend, group.device)  # BackendError if unusable
        target, custom = choice.backend, choice.custom
    if target != group.backend:
        print(f"nbdist: this fit uses process_group_backend={target!r}, the group uses "
              f"{group.backend!r}: the ranks re-form their process group with {target!r} for the "
              f"fit and go back to {group.backend!r} afterwards (per-rank variables are kept).",
              file=sys.stderr)
    spec = {"strategy": strategy, "backend": target, "home": group.backend, "custom": custom,
            "device": group.device, "timeout": group.timeout, "weights": weights}
    return group.call(_fit_on_rank, (make_module, make_data, spec, trainer_kwargs),
                      timeout=timeout)


def _reform(backend: str, timeout: float) -> None:
    """Replace the default process group by one with ``backend`` (same ranks, same store)."""
    dist = _dist()
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    rank, size = dist.get_rank(), dist.get_world_size()
    # Every rank re-forms the same number of times, so this counter gives all a fresh, equal prefix
    # without a collective (which would not work on a group a failed fit left broken).
    generation = (store.add("nbdist-lightning/reforms", 1) - 1) // size
    dist.destroy_process_group()
    store = dist.PrefixStore(f"nbdist-lightning/{generation}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout))


def _build_strategy(pl, strategy, backend: str, world_size: int):
    if not isinstance(strategy, str):
        return strategy
    name, strategies = strategy.lower(), pl.strategies
    if name == "ddp":
        return strategies.DDPStrategy(process_group_backend=backend)
    if name == "fsdp2":
        return strategies.ModelParallelStrategy(data_parallel_size=world_size,
                                                tensor_parallel_size=1,
                                                process_group_backend=backend)
    if name == "fsdp":
        return strategies.FSDPStrategy(process_group_backend=backend)
    return strategy


def _fit_on_rank(make_module, make_data, spec, trainer_kwargs) -> FitResult:
    dist = _dist()
    install_hooks()
    switch = spec["backend"] != spec["home"]
    if switch:
        for backend in spec["custom"]:
            backend.register_in_torch()
        _reform(spec["backend"], spec["timeout"])
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
            _reform(spec["home"], spec["timeout"])
