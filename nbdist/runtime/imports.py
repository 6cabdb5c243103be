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
``torch._dynamo``, which every optimizer imports on a rank's first step, take seconds of CPU in
each fresh rank. The forkserver reads the variable once, when it starts, and skips what it cannot
import; each rank then imports what its own environment lists (:func:`from_env`, strict), so a
name added later is still imported, only by each rank, and a bad one fails the start, by rank.
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


def env_modules() -> List[str]:
    """The modules :data:`ENV_VAR` lists (commas and spaces separate them); raise if one is not a
    module name."""
    names = [n for n in re.split(r"[,\s]+", os.environ.get(ENV_VAR, "")) if n]
    bad = [n for n in names if not _NAME.match(n)]
    if bad:
        raise ValueError(f"{ENV_VAR} must list module names separated by commas, e.g. "
                         f"'deepspeed,torch._dynamo'; {', '.join(map(repr, bad))} is not one "
                         f"(the variable is {os.environ[ENV_VAR]!r})")
    return names


def from_env(strict: bool = True, rank: int = -1) -> None:
    """Import the modules :data:`ENV_VAR` lists. The forkserver passes ``strict=False`` and skips
    what fails (each rank then fails its own start, saying why); a rank raises on the first that
    cannot be imported, naming it and the variable."""
    try:
        names = env_modules()
    except ValueError:
        if strict:
            raise
        return
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 -- the rank says which and why, below
            if strict:
                raise ImportError(
                    f"{ENV_VAR} lists {name!r}, which rank {rank} cannot import "
                    f"({type(exc).__name__}: {exc}). Install it in the ranks' environment, or "
                    f"take it out of {ENV_VAR} (it is {os.environ[ENV_VAR]!r}).") from exc
