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

Threads: :func:`take` runs on the thread starting a group (the caller's, holding the group's
lock); :func:`top_up` on a prewarm thread (``nbdist-prewarm``: at ``%load_ext nbdist``, and after
each spawn start -- never under the group's lock). The pool's own lock (``spares`` in
:data:`nbdist.wire.locks.ORDER`) is a leaf: it guards the list, the spawns in flight, the
top-ups asked for and the epoch; nothing is spawned, reaped or locked under it. A :func:`close`
(at exit: for good) makes every spawn then in flight discard its spare, and waits for them.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 -- its exit handler first (see close's atexit below)
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from ..wire import locks
from ..wire.deadline import Deadline, poll_until
from .forkserver import main_hidden, sigint_held
from .processes import LocalProcess
from .reaper import reap

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
        """End the spare and reap it (:mod:`.reaper`)."""
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(ValueError):  # closed already: reaped before
            reap([LocalProcess(self.process)], Deadline(DISCARD_S))


#: seconds a discarded spare gets to be reaped once killed
DISCARD_S = 5.0


class _Pool:
    #: guards the list, the spawns in flight and the epoch; nothing is spawned or reaped under it
    lock = threading.Condition(locks.make("spares", module_level=True))
    spares: List[Spare] = []
    starting: List[Any] = []  # processes being spawned (not kept yet), for pids()
    wanted: Optional[int] = None  # the last spawn start's world size
    pending = 0  # top-ups asked for in the background (warm()) and not done yet
    epoch = 0  # close() moves it on: a spawn begun before a close keeps nothing
    final = False  # closed at interpreter exit: nothing is spawned any more


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
    """Spawn spares until :func:`target` are kept (or being spawned); how many were started.
    Never raises for a spare that fails to start: the next start spawns its ranks fresh. Several
    top-ups at once share the work (each spawn is counted before it starts); one that a
    :func:`close` overtook keeps nothing."""
    try:
        want = target()
    except ValueError:  # a bad NBDIST_SPARES: the next start says so
        return 0
    ctx = mp.get_context("spawn")
    started = 0
    while True:
        with _Pool.lock:
            if _Pool.final or len(_Pool.spares) + len(_Pool.starting) >= want:
                return started
            epoch = _Pool.epoch
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=spare_main, args=(theirs,), name="nbdist-spare")
            _Pool.starting.append(process)
        spare = None
        try:
            spare = _spawn(process, ours, theirs)
        finally:
            with _Pool.lock:
                _Pool.starting.remove(process)
                keep = spare is not None and epoch == _Pool.epoch and not _Pool.final
                if keep:
                    _Pool.spares.append(spare)
                _Pool.lock.notify_all()
        if not keep:  # failed to start, or a close() came meanwhile: it is not ours to keep
            if spare is not None:
                spare.discard()
            return started
        started += 1


def _spawn(process, ours, theirs) -> Optional[Spare]:
    """Start one spare process (outside the pool's lock); ``None`` if it could not start."""
    try:
        with sigint_held(), main_hidden():
            process.start()
    except (OSError, RuntimeError):
        with contextlib.suppress(OSError):
            ours.close()
            theirs.close()
        return None
    theirs.close()  # the spare has its own copy now
    return Spare(process, ours)


def warm(background: bool = True) -> Optional[threading.Thread]:
    """Top the spares up (:func:`top_up`), in a background thread (returned) unless told not to:
    what ``%load_ext nbdist`` does where workers are spawned, and a spawn start right after it
    took its spares."""
    if not background:
        top_up()
        return None

    def run():
        try:
            top_up()
        finally:
            with _Pool.lock:
                _Pool.pending -= 1
                _Pool.lock.notify_all()

    with _Pool.lock:  # counted before the thread runs: ready() waits for it from now on
        _Pool.pending += 1
    thread = threading.Thread(target=run, name="nbdist-prewarm", daemon=True)
    try:
        thread.start()
    except BaseException:
        with _Pool.lock:
            _Pool.pending -= 1
        raise
    return thread


def _topping_up() -> bool:
    """(Under the pool's lock.) Whether a top-up is asked for or running, or a spare spawning."""
    return bool(_Pool.pending or _Pool.starting)


def settle(timeout: float) -> bool:
    """Wait up to ``timeout`` s until no top-up is asked for or running and no spare is being
    spawned; True if so."""
    with _Pool.lock:
        return _Pool.lock.wait_for(lambda: not _topping_up(), timeout)


def pids() -> List[int]:
    """The process ids of the spares kept now."""
    with _Pool.lock:
        return [s.process.pid for s in _Pool.spares] + \
            [p.pid for p in _Pool.starting if p.pid is not None]


def ready(timeout: float = 0.0) -> int:
    """How many of the spares kept have imported torch, waiting up to ``timeout`` s until every
    top-up asked for is done -- one a start has just asked for (:func:`warm`) and not yet begun
    included -- and every spare kept has imported torch or died (a benchmark or a test waits; a
    start never does)."""
    def settled() -> bool:
        with _Pool.lock:
            kept, busy = list(_Pool.spares), _topping_up()
        return not busy and all(s.ready() or s.process.exitcode is not None for s in kept)

    poll_until(settled, lambda left: time.sleep(min(left, 0.05)), Deadline(timeout))
    with _Pool.lock:
        kept = list(_Pool.spares)
    return sum(s.ready() for s in kept)


def close(final: bool = False) -> None:
    """Kill and reap every spare (a later spawn start tops them up again; not after ``final``,
    what interpreter exit does). A spawn in flight keeps nothing: it is waited for (up to
    :data:`CLOSE_WAIT_S` s) and reaped too -- a spare left behind is a non-daemon child that
    multiprocessing would wait for at exit, forever."""
    with _Pool.lock:
        spares, _Pool.spares = _Pool.spares, []
        _Pool.epoch += 1
        _Pool.final = _Pool.final or final
        _Pool.lock.wait_for(lambda: not _Pool.starting, CLOSE_WAIT_S)  # they discard their own
    for spare in spares:
        spare.discard()


#: how long :func:`close` waits for spares being spawned (each spawn takes well under a second)
CLOSE_WAIT_S = 10.0


# At exit, close() runs before multiprocessing's own exit handler, which waits for every
# non-daemon child -- a spare still kept would hold it forever. (atexit runs the last registered
# first: multiprocessing.util registers its handler when imported, above.)
atexit.register(close, final=True)


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
