"""Warm spares: spawned workers that have imported torch already and wait to become ranks.

Where workers are spawned -- Windows, or ``start_method="spawn"`` elsewhere -- every new rank is a
fresh interpreter that imports torch itself: seconds per rank on a laptop, 10 s or more under Wine,
and as long again on every ``restart()``. A *spare* is such a process started ahead of time: it
imports the worker module (torch with it), then blocks on a pipe until the group hands it a rank's
config (:func:`spare_main`). :func:`nbdist.runtime.launcher.start_workers` takes spares first and
spawns fresh processes only for the ranks left over; right after, it tops the spares up again for
the next start or restart. ``%load_ext nbdist`` fills them first, in the background
(:func:`nbdist.runtime.forkserver.prewarm`).

How many: :data:`ENV_VAR` (``NBDIST_SPARES``) if set -- ``0`` turns spares off -- else the world
size of the last spawn start (:data:`DEFAULT` before any). A spare still importing torch when it
is taken gets its config all the same and starts as soon as the import is done: never later than a
fresh process would. Each spare costs the memory of an interpreter with torch imported.

What a spare keeps from the moment it was spawned, as a forkserver child keeps the forkserver's:
its imports (torch read its import-time environment variables then). What it takes from the start
that uses it: the rank's whole environment (as every worker does), the caller's working directory
and ``sys.path``.

Spares end with the process that started them: closing the pipe ends a waiting spare (a kernel
that dies closes it too), and :func:`close` (at interpreter exit, on kernel shutdown, or by hand)
kills and reaps them all.

Threads: :func:`take` and :func:`top_up` run on the thread starting a group (the caller's, holding
the group's lock) or the prewarm thread; the pool's own lock is a leaf (nothing is taken under it,
processes are spawned outside it).
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from .forkserver import main_hidden, sigint_held

#: the environment variable that sets how many spares to keep (``0``: none)
ENV_VAR = "NBDIST_SPARES"
#: spares kept before any spawn start said how many ranks a group has
DEFAULT = 2


class Spare:
    """One warm worker: its ``multiprocessing.Process`` and our end of its config pipe."""

    def __init__(self, process, conn):
        self.process, self.conn = process, conn
        self.imported = False  #: it said it has imported torch

    def ready(self) -> bool:
        """Whether the spare has imported torch (it says so once, down the pipe)."""
        if not self.imported:
            with contextlib.suppress(OSError, EOFError, ValueError):
                self.imported = self.conn.poll() and self.conn.recv() == "imported"
        return self.imported

    def hand(self, cfg: Dict[str, Any], name: str):
        """Make this spare the rank ``cfg`` describes; its process, or ``None`` if it died. (Whether
    it has finished its imports does not matter: the config waits in the pipe.)"""
        try:
            self.conn.send((cfg, {"cwd": os.getcwd(), "sys_path": list(sys.path)}))
        except (OSError, ValueError):  # it exited (killed by hand, out of memory): not usable
            self.discard()
            return None
        finally:
            with contextlib.suppress(OSError):
                self.conn.close()
        self.process.name = name
        return self.process

    def discard(self) -> None:
        """End the spare and reap it."""
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self.process.kill()
            self.process.join(5.0)
            self.process.close()


class _Pool:
    lock = threading.Lock()  # a leaf: guards the list and the count only
    filling = threading.Lock()  # one top-up at a time (it takes ``lock`` and the __main__ swap)
    spares: List[Spare] = []
    wanted: Optional[int] = None  # the last spawn start's world size
    closing = False
    registered = False


def target() -> int:
    """How many spares to keep: ``NBDIST_SPARES``, else the last spawn start's world size, else
    :data:`DEFAULT`. A value that is not a whole number >= 0 is refused, naming it."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{ENV_VAR} must be a whole number of spare workers to keep warm "
                             f"(0 turns them off), got {raw!r}")
        return value
    return DEFAULT if _Pool.wanted is None else _Pool.wanted


def take(n: int) -> List[Spare]:
    """Up to ``n`` live spares, oldest first (they are the furthest into their imports); the pool
    remembers ``n`` as the size to top up to."""
    _Pool.wanted = n
    taken: List[Spare] = []
    dead: List[Spare] = []
    with _Pool.lock:
        while _Pool.spares and len(taken) < n:
            spare = _Pool.spares.pop(0)
            (taken if spare.process.exitcode is None else dead).append(spare)
    for spare in dead:
        spare.discard()
    return taken


def top_up() -> int:
    """Spawn spares until :func:`target` are kept; how many were started. Never raises for a spare
    that fails to start: the next start spawns its ranks fresh. One top-up at a time."""
    try:
        want = target()
    except ValueError:  # a bad NBDIST_SPARES: the next start says so
        return 0
    with _Pool.filling:
        return _fill(want)


def _fill(want: int) -> int:
    ctx = mp.get_context("spawn")
    started = 0
    while not _Pool.closing:
        with _Pool.lock:
            if len(_Pool.spares) >= want:
                break
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=spare_main, args=(theirs,), name="nbdist-spare")
        try:
            with sigint_held(), main_hidden():
                process.start()
        except (OSError, RuntimeError):
            with contextlib.suppress(OSError):
                ours.close()
                theirs.close()
            break
        theirs.close()  # the spare has its own copy now
        spare = Spare(process, ours)
        with _Pool.lock:
            keep = not _Pool.closing
            if keep:
                _Pool.spares.append(spare)
                _register_close()
        if not keep:
            spare.discard()
            break
        started += 1
    return started


def warm(background: bool = True) -> Optional[threading.Thread]:
    """Top the spares up (:func:`top_up`), in a background thread (returned) unless told not to:
    what ``%load_ext nbdist`` does where workers are spawned."""
    if not background:
        top_up()
        return None
    thread = threading.Thread(target=top_up, name="nbdist-prewarm", daemon=True)
    thread.start()
    return thread


def pids() -> List[int]:
    """The process ids of the spares kept now."""
    with _Pool.lock:
        return [s.process.pid for s in _Pool.spares]


def ready(timeout: float = 0.0) -> int:
    """How many of the spares kept now have imported torch, waiting up to ``timeout`` s for all
    of them (a benchmark or a test waits; a start never does)."""
    deadline = time.monotonic() + timeout
    while True:
        with _Pool.lock:
            kept = list(_Pool.spares)
        done = sum(s.ready() for s in kept)
        if done == len(kept) or time.monotonic() >= deadline:
            return done
        time.sleep(0.05)


def close() -> None:
    """Kill and reap every spare (a later spawn start tops them up again)."""
    with _Pool.lock:
        spares, _Pool.spares = _Pool.spares, []
        _Pool.closing = True
    try:
        for spare in spares:
            spare.discard()
    finally:
        _Pool.closing = False


def _register_close() -> None:
    if not _Pool.registered:
        _Pool.registered = True
        atexit.register(close)


def spare_main(conn) -> None:
    """A spare's life: import the worker module (torch with it), wait for a rank's config, then be
    that rank (:func:`nbdist.runtime.worker.main`). Our end of the pipe closing without a config
    (the group's process exited, or :func:`close`) ends the spare quietly."""
    from . import preload  # noqa: F401 -- SIGINT ignored from here on, then torch
    from .worker import main

    with contextlib.suppress(OSError):  # the group may have closed its end, its config sent
        conn.send("imported")
    try:
        cfg, where = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    conn.close()
    with contextlib.suppress(OSError):
        os.chdir(where["cwd"])
    sys.path[:] = where["sys_path"]
    main(cfg)
