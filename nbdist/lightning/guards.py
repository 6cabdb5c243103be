"""Lightning's guards on a rank: the cluster environment and the patches that keep a plain
``Trainer`` inside the group (see :mod:`nbdist.lightning`).

:func:`install_hooks` runs on every rank at start-up (the runtime's rank hook) and only installs an
import hook: Lightning itself is patched when, and if, user code imports it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any, Dict

# Lightning ships twice: the ``pytorch_lightning`` package and the unified ``lightning`` package.
_FABRIC_OF = {"pytorch_lightning": "lightning_fabric", "lightning.pytorch": "lightning.fabric"}
_SPAWNING = ("spawn", "fork", "notebook")
_patched: set = set()
_env_classes: Dict[str, type] = {}


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


def _backend_key(name: str) -> str:
    from torch.distributed import distributed_c10d as c10d

    try:
        return str(c10d.BackendConfig(c10d.Backend(name)))
    except (ValueError, RuntimeError):  # a name torch does not know in this process
        return name.lower()


class _StdoutHandler(logging.StreamHandler):
    """Writes to the rank's ``sys.stdout`` of the moment (the one nbdist forwards)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def _below_warning(record: logging.LogRecord) -> bool:
    return record.levelno < logging.WARNING


def _info_to_stdout(name: str) -> None:
    """Lightning's package logger prints its INFO lines ("GPU available: False", "`Trainer.fit`
    stopped") through a ``StreamHandler`` of its own on stderr, which a notebook shows as an error:
    send the records below WARNING to stdout, keep warnings and errors on stderr. Idempotent."""
    logger = logging.getLogger(name)
    ours = [h for h in logger.handlers if isinstance(h, _StdoutHandler)]
    theirs = [h for h in logger.handlers if type(h) is logging.StreamHandler]
    if ours or not theirs:  # done already, or Lightning left its records to the root logger
        return
    for handler in theirs:
        handler.addFilter(lambda record: not _below_warning(record))
    info = _StdoutHandler()
    info.setFormatter(theirs[0].formatter)
    info.addFilter(_below_warning)
    logger.addHandler(info)


def _patch(pl: str) -> None:
    if pl in _patched:
        return
    _patched.add(pl)
    from . import deepspeed  # imports nbdist.strategies.deepspeed, which imports no DeepSpeed
    for name in (pl, _FABRIC_OF[pl]):
        _info_to_stdout(name)
    connector = importlib.import_module(pl + ".trainer.connectors.accelerator_connector")
    spawning = importlib.import_module(pl + ".strategies.launchers.multiprocessing")
    parallel = importlib.import_module(pl + ".strategies").ParallelStrategy
    script = importlib.import_module(pl + ".strategies.launchers.subprocess_script")
    env_cls = _environment_class(_FABRIC_OF[pl])
    slurm = importlib.import_module(_FABRIC_OF[pl] + ".plugins.environments").SLURMEnvironment
    validate_srun = slurm._validate_srun_used
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
        deepspeed.adopt(pl, self.strategy)  # Lightning's own DeepSpeedStrategy: CPU-capable
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

    def _validate_srun_used():  # on a rank, told to "prepend srun" where srun is installed
        if not _in_group():  # (Lightning detects SLURM at every fit): the group is the cluster
            validate_srun()

    slurm._validate_srun_used = staticmethod(_validate_srun_used)
    deepspeed.register(pl)  # Trainer(strategy="deepspeed_stage_3") gets the CPU-capable class
    cls._choose_and_init_cluster_environment = _choose_and_init_cluster_environment
    cls._lazy_init_strategy = _lazy_init_strategy
    script._SubprocessScriptLauncher._call_children_scripts = _call_children_scripts
