"""The controller's locks, by name, in the one order a thread may take them; and the check of it.

Every lock the notebook side of nbdist takes while another may be held is made here, by
:func:`make`, under a name from :data:`ORDER`. A thread holding a lock may take one that comes
*later* in :data:`ORDER`, never an earlier one: two threads then can never wait on each other. The
runtime's threading model (:mod:`nbdist.runtime`) says which thread takes which lock and why.

In normal use :func:`make` returns a plain ``threading.Lock``/``RLock`` (nothing is checked, nothing
costs). The test suite calls :func:`check` first: from then on :func:`make` returns an
:class:`OrderedLock` that records every acquisition against the order, and one taken out of order
raises :class:`LockOrderError` in the thread that took it and is kept in :func:`violations` (a
thread nobody joins cannot fail a test by raising, so the suite asserts that list stays empty).
"""
from __future__ import annotations

import threading
import traceback
from typing import List, Tuple

#: Outermost first. ``panel``: a launcher panel's refresh (it reads ``status()``, which takes a
#: job's ``metrics``); ``group``: a group's call/lifecycle lock (held from send to settle);
#: ``ranks``: a running group's rank set -- whoever holds it reads the ranks' control channels and
#: moves their states (the caller's thread in a call, under ``group``; a job's thread while it
#: waits, without ``group``; the teardown) -- :meth:`RankSet.shutdown
#: <nbdist.runtime.ranks.RankSet.shutdown>` takes it, so the ranks are never shut down under a
#: thread that reads them; ``generations``: an attached group's next-generation hand-over;
#: ``relay``: an output relay's buffers (its sink and lifeline hook run under it); ``abort``: an
#: attached group's abort of its remote ranks; ``output``: the output router's folder;
#: ``display``: a job output display (the router shows a job's lines under ``output``);
#: ``sink``: the queue of lines for the user's ``output=`` sink (its thread calls the sink outside
#: it); ``metrics``: a call's logged rows; ``lifeline`` and ``channel``: one writer at a time on a
#: rank's command and control sockets. Then the leaves, under which nothing else is taken:
#: ``pauses`` (a job's ranks at a breakpoint), ``stacks`` (the ranks' stack answers),
#: ``spares`` (the warm spares' list), ``main`` (the ``__main__`` swap while a process spawns),
#: ``interrupts`` (a rank's move between requests, and its watchdog's SIGINT for one: only
#: ``raising`` under it), ``raising`` (a rank's SIGINT raised on Windows), ``segments`` (the
#: shared-memory mappings this process holds, on Windows); last ``pool``: the pooled-segment release
#: hooks (taken from finalizers, which may run under any lock: must stay innermost).
ORDER: Tuple[str, ...] = ("panel", "group", "ranks", "generations", "relay", "abort", "output",
                          "display", "sink", "metrics", "lifeline", "channel", "pauses",
                          "stacks", "spares", "main", "interrupts", "raising", "segments",
                          "pool")
#: Names of which two different locks may nest: a generation's relay hands its streams to the
#: group's relay (``OutputRelay.move_to``) holding its own lock; the group's never takes another.
NESTABLE = frozenset({"relay"})

_checking = False
_held = threading.local()
_violations: List[str] = []


class LockOrderError(AssertionError):
    """A thread took a lock while holding one that :data:`ORDER` puts after it (an internal
    invariant of nbdist broken: a deadlock waiting for the right interleaving)."""


def check(on: bool = True) -> None:
    """Make the locks created from now on check the order (the test suite does, first thing)."""
    global _checking
    _checking = on


def violations(clear: bool = False) -> List[str]:
    """Every out-of-order acquisition seen since :func:`check` (each says who and where); with
    ``clear``, forget them too."""
    seen = list(_violations)
    if clear:
        del _violations[:len(seen)]
    return seen


def make(name: str, reentrant: bool = False, module_level: bool = False):
    """A lock named ``name`` (one of :data:`ORDER`): plain when not checking, checked when the
    suite asked (:func:`check`). ``module_level``: a lock made at import time, before the suite
    could ask -- always an :class:`OrderedLock`, which checks whenever the suite asks."""
    if name not in ORDER:
        raise ValueError(f"unknown lock name {name!r}; the order knows {list(ORDER)}")
    if not _checking and not module_level:
        return threading.RLock() if reentrant else threading.Lock()
    return OrderedLock(name, reentrant)


def require(lock, what: str) -> None:
    """While checking (:func:`check`): record and raise :class:`LockOrderError` unless this
    thread holds ``lock`` -- the threading model says ``what`` happens only under it. (Plain locks
    cannot tell who holds them: nothing is checked then.)"""
    if not _checking or not isinstance(lock, OrderedLock) or lock._is_owned():
        return
    where = "".join(traceback.format_stack(limit=8)[:-2])
    text = (f"thread {threading.current_thread().name!r} {what} without holding lock "
            f"{lock.name!r}, which the threading model (nbdist.runtime) says it needs\n{where}")
    _violations.append(text)
    raise LockOrderError(text)


class OrderedLock:
    """A lock that knows its place in :data:`ORDER` and checks every acquisition against the locks
    the thread already holds. Usable as a context manager and inside ``threading.Condition``."""

    def __init__(self, name: str, reentrant: bool = False):
        self.name, self.level, self.reentrant = name, ORDER.index(name), reentrant
        self._inner = threading.RLock() if reentrant else threading.Lock()

    def __repr__(self) -> str:
        return f"<OrderedLock {self.name} #{id(self):x}>"

    @staticmethod
    def _stack() -> list:
        stack = getattr(_held, "stack", None)
        if stack is None:
            stack = _held.stack = []
        return stack

    def _check_order(self) -> None:
        for other in self._stack():
            if other is self:
                continue
            if other.level > self.level or (other.level == self.level
                                            and self.name not in NESTABLE):
                where = "".join(traceback.format_stack(limit=8)[:-2])
                text = (f"thread {threading.current_thread().name!r} took lock {self.name!r} "
                        f"while holding {other.name!r}; the order is {' -> '.join(ORDER)}\n"
                        f"{where}")
                _violations.append(text)
                raise LockOrderError(text)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """As ``threading.Lock.acquire``, after checking the order (while the suite checks)."""
        if _checking:
            self._check_order()
        got = self._inner.acquire(blocking, timeout)
        if got:
            self._stack().append(self)
        return got

    def release(self) -> None:
        """As ``threading.Lock.release``."""
        stack = self._stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break
        self._inner.release()

    def __enter__(self) -> "OrderedLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- what threading.Condition uses to wait with the lock released --------------------------
    def _is_owned(self) -> bool:
        return self in self._stack()

    def _release_save(self):
        stack = self._stack()
        count = sum(1 for lock in stack if lock is self)
        stack[:] = [lock for lock in stack if lock is not self]
        if self.reentrant:
            return count, self._inner._release_save()
        self._inner.release()
        return count, None

    def _acquire_restore(self, saved) -> None:
        count, state = saved
        if _checking:
            self._check_order()
        if self.reentrant:
            self._inner._acquire_restore(state)
        else:
            self._inner.acquire()
        self._stack().extend([self] * count)
