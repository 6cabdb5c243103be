"""Imports done early on the ranks, between calls: :meth:`nbdist.Group.preload`.

A heavy library (Lightning takes about 2.5 s to import here) is otherwise imported by the first
call that needs it, while the user waits. :func:`start` runs on each rank as a short call: it
checks that each module is there (a top-level lookup, which imports nothing), queues those not
imported yet and returns; the worker sends the reply, then runs :func:`run_pending` -- the imports,
in its main thread, before it reads the next request. So the caller gets control back at once, and
a call that arrives meanwhile starts when the imports are done: never at the same time as them
(two threads importing one package can see each other's half-initialised modules). An import
that fails here fails again, with its traceback, in the call that uses the module.

:data:`ENV_VAR` (``NBDIST_PRELOAD``) names modules every rank has imported before its first call.
The forkserver imports them once, after torch (:mod:`.preload`; a warm spare does too), so a rank
forked from it starts with them and a start or restart skips their import: DeepSpeed and
``torch._dynamo`` (which every torch optimizer imports on a rank's first step) take seconds of CPU
in each fresh rank. The forkserver reads the variable once, when it starts, and skips what it
cannot import; each rank then imports what its own environment lists (:func:`from_env`, strict),
so a name added later is still imported, only by each rank, and a bad one fails the start, by
rank. Local starts check the list first (:func:`check`): a misspelt or missing module is refused
before any rank starts.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import List, Sequence

#: the environment variable naming modules to import before a rank's first call (comma-separated)
ENV_VAR = "NBDIST_PRELOAD"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

_pending: List[str] = []  # modules to import once the current call has replied (on a rank)


def start(modules: Sequence[str]) -> List[str]:
    """On a rank: queue ``modules`` for import right after this call's reply; return those queued."""
    missing = [m for m in modules if importlib.util.find_spec(m.partition(".")[0]) is None]
    if missing:
        raise ModuleNotFoundError(f"preload: no module named {', '.join(map(repr, missing))} on "
                                  f"this rank (python {sys.executable}); install it in the "
                                  "ranks' environment, or leave it out.")
    todo = [m for m in modules if m not in sys.modules and m not in _pending]
    _pending.extend(todo)
    return todo


def run_pending() -> None:
    """On a rank, between calls (the worker calls it after each reply): import what is queued."""
    while _pending:
        name = _pending.pop(0)
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 -- the call that uses it imports it again, and says
            pass


def env_modules(environ=None) -> List[str]:
    """The modules :data:`ENV_VAR` lists in ``environ`` (default: this process's environment;
    commas and spaces separate them); raise if one is not a module name."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    names = [n for n in re.split(r"[,\s]+", value) if n]
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ValueError(f"{ENV_VAR} must list module names separated by commas, e.g. "
                         f"'deepspeed,torch._dynamo'; not a module name: "
                         f"{', '.join(map(repr, bad))} (the variable is {value!r})")
    return names


def listed(package: str) -> bool:
    """Whether :data:`ENV_VAR` lists ``package`` or one of its modules (a list that is not one of
    module names: no; a start refuses it)."""
    try:
        return any(n.partition(".")[0] == package for n in env_modules())
    except ValueError:
        return False


def check(environ) -> None:
    """Before local ranks start (they run this Python, on this ``sys.path``): refuse an
    :data:`ENV_VAR` in ``environ`` that is not a list of module names, or whose top-level
    packages this Python cannot find (a lookup: nothing is imported here)."""
    names = env_modules(environ)
    missing = [n for n in names if importlib.util.find_spec(n.partition(".")[0]) is None]
    if missing:
        raise ModuleNotFoundError(
            f"{ENV_VAR} lists {', '.join(map(repr, missing))}, which this Python "
            f"({sys.executable}) cannot find; install it, or take it out of {ENV_VAR} (it is "
            f"{environ[ENV_VAR]!r})")


def from_env(strict: bool = True, rank: int = -1) -> None:
    """Import the modules :data:`ENV_VAR` lists. The forkserver passes ``strict=False`` and skips
    what fails (each rank then fails its own start, saying why), with torch told to look for CUDA
    through NVML meanwhile (``PYTORCH_NVML_BASED_CUDA_CHECK``), so that a module asking
    ``torch.cuda.is_available()`` as it is imported (DeepSpeed does) does not initialise CUDA,
    which no forked rank could then use; a rank raises on the first module it cannot import,
    naming it and the variable."""
    try:
        names = env_modules()
    except ValueError:
        if strict:
            raise
        return
    nvml = "PYTORCH_NVML_BASED_CUDA_CHECK"
    saved = os.environ.get(nvml)
    if not strict:
        os.environ.setdefault(nvml, "1")
    try:
        for name in names:
            if name not in sys.modules:
                _import(name, strict, rank)
    finally:
        if not strict and saved is None:
            os.environ.pop(nvml, None)


def _import(name: str, strict: bool, rank: int) -> None:
    try:
        importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 -- SystemExit too: the forkserver must live on
        if strict and isinstance(exc, KeyboardInterrupt):
            raise
        if strict:
            raise ImportError(
                f"{ENV_VAR} lists {name!r}, which rank {rank} cannot import "
                f"({type(exc).__name__}: {exc}). Install it in the ranks' environment, or "
                f"take it out of {ENV_VAR} (it is {os.environ[ENV_VAR]!r}).") from exc
