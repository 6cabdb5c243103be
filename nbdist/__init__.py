"""nbdist: PyTorch distributed training you can do and see from a Jupyter notebook.

``nbdist.start(world_size=4)`` starts a persistent group of fresh worker processes with
torch.distributed initialised; ``group.run(fn)`` / ``group.exec(source)`` run code on every rank and
return per-rank results. In a notebook, ``%load_ext nbdist`` adds ``%dist_start`` and ``%%dist``.

This module imports no IPython, ipywidgets or matplotlib: it works in a plain script too.
"""
import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.machinery as _machinery
import sys as _sys

from .backends import available_backends, register_backend, resolve_backend
from .errors import (BackendError, DistTimeoutError, GroupBusyError, GroupClosedError,
                     GroupInterrupted, JobPausedError, NbdistError, RankDiedError, RemoteError)
from .runtime.api import attach, launch, start, stop_all
from .runtime.engines import reattach
from .runtime.group import Group, current_group, use_group
from .runtime.jobs import Job
from .runtime.metrics import Metrics
from .runtime.stacks import Stacks
from .runtime.ranklog import log

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

__all__ = sorted([
    "BackendError",
    "DistTimeoutError",
    "Group",
    "GroupBusyError",
    "GroupClosedError",
    "GroupInterrupted",
    "JobPausedError",
    "Job",
    "Metrics",
    "Stacks",
    "NbdistError",
    "RankDiedError",
    "RemoteError",
    "attach",
    "available_backends",
    "current_group",
    "launch",
    "load_ipython_extension",
    "log",
    "reattach",
    "register_backend",
    "resolve_backend",
    "start",
    "step",
    "stop_all",
    "unload_ipython_extension",
    "use_group",
])


#: The documented subpackages: ``nbdist.memory.measure(...)`` works without importing them first;
#: each loads on first use (``import nbdist`` stays light).
SUBPACKAGES = ("backends", "bench", "engines", "errors", "lightning", "memory", "parallel",
               "strategies", "ui")

#: Modules that moved when nbdist grew packages, still importable under the path the docs gave
#: them (``python -m nbdist.worker``, ``"nbdist.store_backend:create"``, ``import nbdist.shm``).
MOVED = {
    "nbdist.shm": "nbdist.backends.shm",
    "nbdist.store_backend": "nbdist.backends.store",
    "nbdist.worker": "nbdist.runtime.worker",
    "nbdist.group": "nbdist.runtime.group",
    "nbdist.launcher": "nbdist.runtime.launcher",
    # not moved but short: the engines as the docs name them, nbdist.slurm.start(...), nbdist.k8s
    "nbdist.slurm": "nbdist.engines.slurm",
    "nbdist.ray": "nbdist.engines.ray",  # nbdist.ray.start(...): the Ray engine
    "nbdist.k8s": "nbdist.engines.k8s",
}


def __getattr__(name):
    if name == "step":  # nbdist.step(): the step breakdown, from nbdist.bench (loaded on use)
        from .bench.steps import step

        return step
    if name in SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    if f"{__name__}.{name}" in MOVED:
        return _importlib.import_module(MOVED[f"{__name__}.{name}"])
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | set(SUBPACKAGES) | {"__version__"})


class _Alias(_importlib_abc.Loader):
    """Loads an old module path as the module that now lives at ``target`` (one object, not a copy);
    ``python -m`` on the old path runs the new module's code."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = _importlib.import_module(self.target)
        self._spec, self._loader = module.__spec__, module.__loader__
        _sys.modules[spec.name] = module
        return module

    def exec_module(self, module):
        # Already executed under its real name; keep its own spec (the import system set ours).
        module.__spec__, module.__loader__ = self._spec, self._loader

    def get_code(self, fullname):  # runpy (python -m OLD.PATH)
        real = _importlib.util.find_spec(self.target)
        return real.loader.get_code(self.target)


class _MovedFinder(_importlib_abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        if _sys.argv[:1] == ["-m"]:
            # python -m OLD.PATH: run the real module as __main__, relative imports included.
            real = _importlib.util.find_spec(MOVED[fullname])
            return _machinery.ModuleSpec(real.name, _Alias(real.name), origin=real.origin)
        return _machinery.ModuleSpec(fullname, _Alias(MOVED[fullname]))


if not any(isinstance(f, _MovedFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_MovedFinder())


def _name_cells():
    """In IPython (a notebook's kernel), code sent to the ranks from a cell keeps its cell's name
    there: tracebacks and stacks say ``Cell In[5], line 4`` (:mod:`nbdist.ui.cells`). IPython is
    already imported then; elsewhere nothing is."""
    if "IPython" in _sys.modules:
        from .ui.cells import install

        install()


_name_cells()


def load_ipython_extension(ipython):
    """``%load_ext nbdist``: register the magics (imports IPython only now)."""
    from .ui.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    """``%unload_ext nbdist``: remove the magics and stop the groups they started."""
    from .ui.magics import unload_ipython_extension as unload

    unload(ipython)
