"""Phase counters in shared memory: how the ranks of an ``nbdist_shm`` group wait for each other.

Every rank owns one 32-bit counter in the group's segment and is the only one to write it.
A collective is a sequence of *phases*, numbered the same on every rank. In phase ``p`` a
rank (1) writes what it contributes into its own slot, (2) *arrives*: stores ``p`` in its
counter and wakes the ranks sleeping on it, (3) *waits* until the counters of the ranks it
reads from are ``>= p``, (4) reads their slots. Data for phase ``p`` lives in half ``p % 2``
of a slot, so phase ``p + 1`` can be filled while phase ``p`` is still being read. Before
writing phase ``p`` a rank *guards*: it waits until every rank has arrived at ``p - 1``,
i.e. has finished reading phase ``p - 2``, the last user of that half. No atomic
read-modify-write is needed, and the counters wrap around at 2**32 harmlessly.

Memory ordering. A rank writes its data (torch copies) before it stores the counter, and a
reader loads the counter before it reads the data. On x86-64 (TSO: stores become visible in
program order, loads are not reordered with older loads; glibc's non-temporal memcpy ends
with ``sfence``) that is enough. Other CPUs are refused at group creation.

Waiting. A waiter checks the counter; when every rank has a core of its own it polls for up
to ``SPIN_S``, yielding the core between checks (``sched_yield``: a peer that shares the core
runs at once, and the waiter sees its arrival without paying for a wake-up). Then it sleeps in
``futex(FUTEX_WAIT)`` on the counter's address (a shared futex: it works across processes
that map the same file), at most ``POLL_S`` at a time. Between sleeps it checks the
deadline derived from the group timeout, whether a peer marked the group broken, and, every
``LIVENESS_S``, whether the peers it waits for are still alive (``/proc/<pid>/stat``: a
zombie or a reused pid counts as dead). So a dead or absent peer gives an error, never a hang.
"""
from __future__ import annotations

import ctypes
import os
import time

from ..cores import usable_cores  # chunks, spinning, thread cap: rank 0's answer, shared
from .errors import ShmBackendError

__all__ = ["LIVENESS_S", "POLL_S", "SPIN_S", "Sync", "process_alive", "process_start_time",
           "usable_cores"]

POLL_S = 0.02
"""Longest single futex sleep: how quickly a waiter notices an abort flag or its deadline."""

LIVENESS_S = 0.1
"""How often a waiter checks that the peers it waits for are alive."""

SPIN_S = 200e-6
"""How long a waiter polls before it sleeps, when every rank has a core of its own. Waking a
sleeping process costs tens of microseconds (more on a VM): polling a little first keeps
small collectives fast. With fewer cores than ranks it does not poll at all."""

_MASK = 0xFFFFFFFF
_HALF = 1 << 31
_SYS_FUTEX = 202  # x86-64; other machines are refused in segment.py
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): works across processes
_INT_MAX = (1 << 31) - 1



class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


try:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall  # CDLL: releases the GIL
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError, TypeError):  # not Linux/glibc (Windows: CDLL(None) is a TypeError)
    _syscall = None


def _futex_wait(addr, expected, timeout_s):
    """Sleep while the 32-bit word at ``addr`` equals ``expected`` (at most ``timeout_s``)."""
    if _syscall is None:  # pragma: no cover
        time.sleep(min(timeout_s, 1e-4))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAIT),
             ctypes.c_long(expected), ctypes.byref(ts), None, ctypes.c_long(0))


def _futex_wake(addr):
    """Wake every process sleeping on the word at ``addr``."""
    if _syscall is not None:
        _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_long(_FUTEX_WAKE),
                 ctypes.c_long(_INT_MAX), None, None, ctypes.c_long(0))


def process_start_time(pid):
    """Start time of ``pid`` in clock ticks since boot (0 when unknown): with the pid it
    identifies a process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def process_alive(pid, start_time):
    """False when ``pid`` has exited, is a zombie, or is now another process."""
    if pid <= 0:
        return True  # not published yet: cannot tell, assume alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return False
    return start_time == 0 or int(fields[19]) == start_time


def _reached(value, target):
    """``value >= target`` for 32-bit counters that wrap around."""
    return ((value - target) & _MASK) < _HALF


class Sync:
    """One rank's view of the group's counters, abort flags and peer identities.

    ``seg`` is the :class:`~nbdist.shm.segment.Segment`; ``where(op)`` returns the text that
    names the current call in error messages (e.g. "all_reduce on rank 0 of group '3'").
    """

    def __init__(self, seg, rank, size, timeout_s, where):
        """Bind to segment ``seg`` as ``rank`` of ``size``; waits fail after ``timeout_s``."""
        self.seg, self.rank, self.size = seg, rank, size
        self.timeout_s = timeout_s
        self.where = where
        self.phase = 0  # the last phase this rank arrived at (counters start at 0)
        self.broken = None  # the message of the error that broke the group, if any
        self._counters = [seg.counter(r) for r in range(size)]
        self._addrs = [ctypes.addressof(c) for c in self._counters]
        self._all = list(range(size))
        self._others = [r for r in self._all if r != rank]
        # Spinning only pays when every rank has a core of its own; otherwise it steals the
        # core from the rank being waited for. (This rank's own view: it only sets timing.)
        self.spin_s = SPIN_S if size <= usable_cores() else 0.0

    # -- phases ----------------------------------------------------------------------------
    def arrive(self, p):
        """Publish that this rank has written everything of phase ``p`` (and read ``p - 1``)."""
        self._counters[self.rank].value = p & _MASK
        _futex_wake(self._addrs[self.rank])
        self.phase = p

    def guard(self, p, op):
        """Wait until phase ``p``'s half may be overwritten (every rank arrived at ``p - 1``)."""
        self.wait(self._others, p - 1, op)

    def wait(self, ranks, p, op):
        """Wait until every rank in ``ranks`` has arrived at phase ``p``; raise instead of hanging.

        Raises :class:`ShmBackendError` (and marks the group broken for everyone) when the
        deadline passes, a waited-for peer died, or another rank broke the group.
        """
        target = p & _MASK
        counters = self._counters
        pending = [j for j in ranks if not _reached(counters[j].value, target)]
        if not pending:
            return
        if self.spin_s:
            end = time.perf_counter() + self.spin_s
            while pending and time.perf_counter() < end:
                os.sched_yield()  # lets a peer that shares this core run
                pending = [j for j in pending if not _reached(counters[j].value, target)]
            if not pending:
                return
        now = time.monotonic()
        deadline, next_check = now + self.timeout_s, now + LIVENESS_S
        for j in pending:
            while True:
                value = counters[j].value
                if _reached(value, target):
                    break
                self._raise_if_aborted(op)
                now = time.monotonic()
                if now >= deadline:
                    late = [k for k in pending if not _reached(counters[k].value, target)]
                    self.fail(f"{self.where(op)} timed out after {self.timeout_s:g}s waiting for "
                              f"rank(s) {late}: they are alive but did not reach this collective "
                              "(still busy, hung, or calling different collectives)")
                if now >= next_check:
                    self._check_alive(pending, target, op)
                    next_check = now + LIVENESS_S
                _futex_wait(self._addrs[j], value, min(POLL_S, max(deadline - now, 1e-4)))

    # -- failures --------------------------------------------------------------------------
    def _check_alive(self, pending, target, op):
        for k in pending:
            if _reached(self._counters[k].value, target):
                continue
            pid, start = self.seg.identity(k)
            if not process_alive(pid, start):
                self.fail(f"{self.where(op)} failed: rank {k} (pid {pid}) of the group died. "
                          "Destroy the process group and create a new one.")

    def _raise_if_aborted(self, op):
        for k in self._others:
            message = self.seg.abort_message(k)
            if message is not None:
                self.fail(f"{self.where(op)} failed because rank {k} broke the group: {message}",
                          publish=False)

    def check_usable(self, op):
        """Raise if this group was broken earlier, here or on another rank."""
        if self.broken is not None:
            raise ShmBackendError(f"{self.where(op)}: the group is unusable after an earlier "
                                  f"error ({self.broken}). Destroy it and create a new one.")
        self._raise_if_aborted(op)

    def abandon(self, message):
        """Mark the group broken, here and for the peers (who will quote ``message``)."""
        self.broken = message
        self.seg.set_abort(self.rank, message)
        for addr in self._addrs:  # wake everyone, whatever counter they sleep on
            _futex_wake(addr)

    def fail(self, message, publish=True):
        """Mark the group broken (for the peers too, unless ``publish`` is False) and raise."""
        if publish:
            self.abandon(message)
        self.broken = message
        raise ShmBackendError(message)
