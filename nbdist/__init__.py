"""nbdist: PyTorch distributed training you can do and see from a Jupyter notebook.

``nbdist.start(world_size=4)`` starts a persistent group of fresh worker processes with
torch.distributed initialised; ``group.run(fn)`` / ``group.exec(source)`` run code on every rank and
return per-rank results. In a notebook, ``%load_ext nbdist`` adds ``%dist_start`` and ``%%dist``.

This module imports no IPython, ipywidgets or matplotlib: it works in a plain script too.
"""
from .backends import available_backends, register_backend, resolve_backend
from .errors import (BackendError, DistTimeoutError, GroupClosedError, GroupInterrupted,
                     NbdistError, RankDiedError, RemoteError)
from .group import Group, attach, current_group, launch, start, stop_all, use_group

__version__ = "0.1.0"

__all__ = sorted([
    "BackendError",
    "DistTimeoutError",
    "Group",
    "GroupClosedError",
    "GroupInterrupted",
    "NbdistError",
    "RankDiedError",
    "RemoteError",
    "attach",
    "available_backends",
    "current_group",
    "launch",
    "load_ipython_extension",
    "register_backend",
    "resolve_backend",
    "start",
    "stop_all",
    "unload_ipython_extension",
    "use_group",
])


_SUBMODULES = ("bench", "lightning", "memory", "shm", "strategies", "ui")


def __getattr__(name):
    # nbdist.memory.measure(...) etc. without an explicit import; each loads on first use.
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'nbdist' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """``%load_ext nbdist``: register the magics (imports IPython only now)."""
    from .ui.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython):
    """``%unload_ext nbdist``: remove the magics and stop the groups they started."""
    from .ui.magics import unload_ipython_extension as unload

    unload(ipython)
