"""Imports done early on the ranks, between calls: :meth:`nbdist.Group.preload`.

A heavy library (Lightning takes about 2.5 s to import here) is otherwise imported by the first
call that needs it, while the user waits. :func:`start` runs on each rank as a short call: it
checks that each module is there (a top-level lookup, which imports nothing), queues those not
imported yet and returns; the worker sends the reply, then runs :func:`run_pending` -- the imports,
in its main thread, before it reads the next request. So the caller gets control back at once, and
a call that arrives meanwhile starts when the imports are done: never at the same time as them
(two threads importing one package can see each other's half-initialised modules). An import
that fails here fails again, with its traceback, in the call that uses the module.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import List, Sequence

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
