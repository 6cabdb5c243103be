"""The caller's handles on its ranks: one :class:`Rank` each, whatever started the process, and the
:class:`RankSet` a call talks to.

A rank's process is either a :class:`LocalProcess` (a worker nbdist started: it has a sentinel and
an exit code) or a :class:`RemoteProcess` (started by torchrun/srun elsewhere: alive while its
lifeline is connected). Both answer the same questions -- ``exit_status``, ``kill()``, ``join()``
-- so nothing above this module asks which kind it has.

A failed attached group ends its remote ranks itself (:meth:`RankSet.abort_remote`): the moment one
rank's lifeline closes unexpectedly -- or a call ends in a death, or a rank is killed -- every other
remote rank is told to exit with :data:`~nbdist.wire.relay.ABORT_EXIT_CODE`, even one blocked inside
a collective (its watchdog thread exits the process). torchrun then ends the job with a failure
(or restarts it, with ``--max-restarts``) instead of holding the nodes.
"""
from __future__ import annotations

import queue
import selectors
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

from ..errors import ExitStatus
from ..wire import transport
from ..wire.relay import ABORT_EXIT_CODE, OutputRelay


#: Whether a process sentinel can wait in a selector next to sockets. Not on Windows, where
#: ``select()`` takes sockets only and a sentinel is a process handle: there, exits are polled
#: every :data:`POLL_S` seconds instead (tests switch this off to run that path on Linux).
SENTINELS_SELECTABLE = sys.platform != "win32"
POLL_S = 0.1


def watch_exits(sel: selectors.BaseSelector, ranks: Iterable["Rank"]) -> Dict[int, Any]:
    """Register each rank's sentinel in ``sel`` as ``("dead", rank)``; return the processes that
    must be polled instead (where sentinels are not selectable), by rank."""
    polled = {}
    for r in ranks:
        if r.process.sentinel is None:
            continue
        if SENTINELS_SELECTABLE:
            sel.register(r.process.sentinel, selectors.EVENT_READ, ("dead", r.rank))
        else:
            polled[r.rank] = r.process
    return polled


def select_exits(sel: selectors.BaseSelector, polled: Dict[int, Any],
                 timeout: Optional[float]) -> List[Any]:
    """``sel.select(timeout)`` as ``(data, fileobj)`` pairs, plus ``(("dead", r), None)`` for each
    polled process that has exited (the wait is then at most :data:`POLL_S`)."""
    if polled:
        timeout = POLL_S if timeout is None else min(timeout, POLL_S)
    events = [(key.data, key.fileobj) for key, _ in sel.select(timeout)]
    return events + [(("dead", r), None) for r, p in list(polled.items())
                     if p.exit_status is not None]


class LocalProcess:
    """A worker nbdist started (a ``multiprocessing.Process``).

    Any thread may ask for its ``exit_status`` or ``kill()`` it while the group's thread
    :meth:`release` s it: each reads the handle once, and a handle released meanwhile means the
    exit status is known (``release`` records it first).
    """

    def __init__(self, process):
        self._process = process
        self.pid: Optional[int] = process.pid
        self.sentinel = process.sentinel
        self._status: Optional[ExitStatus] = None

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """``None`` while the process runs; its :class:`ExitStatus` after."""
        process = self._process  # once: release() may clear it from another thread
        if self._status is None and process is not None:
            try:
                code = process.exitcode
            except ValueError:  # closed by release() meanwhile, which recorded the status
                code = None
            if code is not None and self._status is None:
                self._status = ExitStatus(code)
        return self._status

    def kill(self) -> None:
        """SIGKILL the process (safe from any thread, and after it exited)."""
        process = self._process
        if self._status is None and process is not None:
            try:
                process.kill()
            except (OSError, ValueError):
                pass  # reaped and closed meanwhile

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the process to exit."""
        process = self._process
        if self._status is None and process is not None:
            try:
                process.join(timeout)
            except ValueError:
                pass  # released meanwhile: it has exited

    def expect_exit(self) -> None:
        """Nothing to note: the exit code says how it ended."""

    def abort(self) -> bool:
        """A local rank is stopped or killed by the group's teardown: nothing to do here."""
        return False

    def release(self) -> None:
        """Free the process handle once it has exited (its exit status is kept)."""
        if self.exit_status is not None and self._process is not None:
            process, self._process = self._process, None
            process.close()


class RemoteProcess:
    """A rank nbdist did not start (torchrun/srun on another host): alive while its lifeline is.

    After the lifeline closes, its exit status is 0 if the rank was told to stop,
    :data:`ABORT_EXIT_CODE` if it was told to abort, else ``lost``. A rank whose host stopped
    answering (on its lifeline or its control ``channel``: no end of stream ever comes) is ``lost``
    at once, saying so.
    """

    sentinel = None

    def __init__(self, rank: int, pid: int, host: str, relay: OutputRelay, node: str = "?",
                 channel: Optional[transport.Channel] = None):
        self.rank, self.pid, self.host, self.node, self._relay = rank, pid, host, node, relay
        self.channel = channel
        self._expected: Optional[int] = None  # the exit code we asked for

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """``None`` while connected, then ``ExitStatus(0)`` or ``ExitStatus(lost=True)``."""
        lifeline = self._relay.lifeline(self.rank)
        if lifeline is None:
            return None
        silent = lifeline.why or self._silent
        if silent:
            return ExitStatus(lost=True, where=self.where, why=silent)
        if lifeline.alive:
            return None
        if self._expected is not None:
            return ExitStatus(self._expected)
        return ExitStatus(lost=True, where=self.where)

    @property
    def _silent(self) -> str:
        """Why the control channel was given up, if its peer's host stopped answering."""
        channel = self.channel
        return channel.failure if channel is not None and channel.peer_silent else ""

    @property
    def where(self) -> str:
        """``"node 1, host gpu7"`` (``"host gpu7"`` when the launcher named no node): how
        messages place this rank."""
        node = f"node {self.node}, " if self.node not in ("", "?") else ""
        return f"{node}host {self.host}"

    @property
    def ended_by_us(self) -> bool:
        """True if the group told this rank to stop or to abort."""
        return self._expected is not None

    def expect_exit(self) -> None:
        """We asked the rank to stop: its lifeline closing then means a clean exit."""
        if self._expected is None:
            self._expected = 0

    def abort(self) -> bool:
        """Tell the rank to exit with :data:`ABORT_EXIT_CODE` (its group failed); True if told."""
        lifeline = self._relay.lifeline(self.rank)
        if self._expected == ABORT_EXIT_CODE or lifeline is None or not lifeline.abort():
            return False
        self._expected = ABORT_EXIT_CODE
        return True

    def kill(self) -> None:
        """Ask the worker's watchdog to SIGKILL its own process."""
        lifeline = self._relay.lifeline(self.rank)
        if lifeline is not None:
            lifeline.kill()

    def use_relay(self, relay: OutputRelay) -> None:
        """The rank's streams moved to ``relay`` (a generation admitted in the background)."""
        self._relay = relay

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until the rank's streams are closed (not at all once its host stopped answering:
        nothing more will come from it)."""
        if not self._silent:
            self._relay.wait_closed(self.rank, 3600.0 if timeout is None else timeout)

    def release(self) -> None:
        """Nothing to release."""


@dataclass
class Rank:
    """The caller's handle on one rank.

    ``state`` is ``"starting"`` until the rank reported ready, then ``"idle"`` / ``"busy"`` (set by
    the call in flight), and finally ``"dead"`` or ``"stopped"`` (set by the group's teardown).
    """

    rank: int
    process: Any  # LocalProcess | RemoteProcess
    channel: Optional[transport.Channel] = None
    info: Optional[Dict[str, Any]] = None
    state: str = "starting"
    busy_with: str = ""
    since: Optional[float] = None
    last_error: str = ""
    generation: int = 1  #: 2, 3, ... for ranks torchrun restarted (attached groups)

    @property
    def pid(self) -> Optional[int]:
        """The worker's process id (on its own host)."""
        return self.process.pid

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """``None`` while the process runs."""
        status = self.process.exit_status
        why = getattr(self.channel, "failure", "")
        if why and status is not None:  # its connection refused a message: that is the cause
            return ExitStatus(lost=True, where=getattr(self.process, "where", ""), why=why)
        return status


def kill_all(ranks: Iterable[Rank], join: float = 5.0) -> None:
    """SIGKILL every rank still running, reap them within ``join`` s (all of them together: a
    rank on an unreachable host costs no more than one that exits), close their channels."""
    ranks = list(ranks)
    for r in ranks:
        if r.exit_status is None:
            r.process.kill()
    deadline = time.monotonic() + join
    for r in ranks:
        r.process.join(max(0.0, deadline - time.monotonic()))
        r.process.release()
        if r.channel is not None:
            r.channel.close()


class RankSet:
    """The ranks of a running group as a call sees them: their control channels and sentinels in
    one selector, the lifelines, and the pooled result segments the caller gave back.

    Owned by the group from a successful start to its teardown; used by one call at a time.
    """

    def __init__(self, ranks: List[Rank], relay: OutputRelay):
        self.ranks = ranks
        self.relay = relay
        self._freed: Dict[int, "queue.SimpleQueue[str]"] = {r.rank: queue.SimpleQueue()
                                                            for r in ranks}
        self.aborted: List[int] = []  #: remote ranks told to exit because the group failed
        self._abort_lock = threading.RLock()  # the relay's hook may re-enter abort_remote
        self._in_hook = False
        self.remote = any(isinstance(r.process, RemoteProcess) for r in ranks)
        if self.remote:
            relay.on_close = self._lifeline_closed
        self._sel = selectors.DefaultSelector()
        for r in ranks:
            self._sel.register(r.channel.sock, selectors.EVENT_READ, ("ctl", r.rank))
        self._polled = watch_exits(self._sel, ranks)

    def __getitem__(self, r: int) -> Rank:
        return self.ranks[r]

    def select(self, timeout: Optional[float]):
        """``[(what, rank)]`` that are ready: ``("ctl", r)`` a message, ``("dead", r)`` an exit."""
        return [data for data, _ in select_exits(self._sel, self._polled, timeout)]

    def forget(self, r: int) -> None:
        """Stop watching rank ``r`` (it died, or its channel is torn): no busy loop on its fds."""
        rank = self.ranks[r]
        self._polled.pop(r, None)
        for obj in (rank.channel.sock, rank.process.sentinel):
            if obj is not None:
                try:
                    self._sel.unregister(obj)
                except (KeyError, ValueError, OSError):
                    pass

    def freed(self, path: str, r: int) -> None:
        """A pooled segment of rank ``r`` is free again (any thread, or a finalizer)."""
        q = self._freed.get(r)
        if q is not None:
            q.put(path)  # SimpleQueue.put is safe from finalizers and any thread

    def release(self, r: int, paths) -> None:
        """Give the pooled segments of a reply nobody will unpickle back to rank ``r``."""
        for path in paths or ():
            self.freed(path, r)

    def take_freed(self, r: int) -> List[str]:
        """The segments to tell rank ``r`` about with its next request."""
        q, out = self._freed.get(r), []
        while q is not None:
            try:
                out.append(q.get_nowait())
            except queue.Empty:
                break
        return out

    def interrupt(self, r: int) -> bool:
        """SIGINT rank ``r``'s main thread through its lifeline."""
        lifeline = self.relay.lifeline(r)
        return lifeline is not None and lifeline.interrupt()

    def kill(self, ranks: Iterable[int]) -> None:
        """SIGKILL these ranks (without waiting)."""
        for r in ranks:
            self.ranks[r].process.kill()

    def _lifeline_closed(self, r: int) -> None:
        """(Relay thread.) A remote rank's connection ended: unless we asked for it, the group
        has failed -- its collectives can never complete -- so end the other remote ranks now."""
        if self._in_hook or not 0 <= r < len(self.ranks) or \
                getattr(self.ranks[r].process, "ended_by_us", True):
            return
        self._in_hook = True  # the relay's lock serialises this hook; drain() may re-enter it
        try:
            self.relay.drain()  # ranks that died at the same time are seen as dead, not aborted
            self.abort_remote()
        finally:
            self._in_hook = False

    def abort_remote(self, dead: Iterable[int] = ()) -> List[int]:
        """Tell every remote rank still connected -- except the ``dead`` ones, known lost -- to
        exit with :data:`ABORT_EXIT_CODE` (any thread; idempotent); return all the ranks told so
        far, sorted."""
        self.relay.drain()  # a rank whose end of stream already arrived is dead, not aborted
        dead = set(dead)
        with self._abort_lock:
            for r in self.ranks:
                if r.rank in dead or getattr(r.channel, "failure", ""):
                    continue  # lost, or its connection refused a message: not aborted by us
                if r.exit_status is None and r.process.abort():
                    self.aborted.append(r.rank)
            return sorted(self.aborted)

    def shutdown(self, wait: float = 2.0) -> None:
        """Ask the idle ranks to stop (they destroy their process group and exit), kill the
        others, reap every process within ``wait`` seconds (killing stragglers), close all."""
        stop_msg = transport.encode(("stop", 0, None))
        torn = False
        for r in self.ranks:
            if r.rank in self.aborted:
                continue  # exiting on its own (told to abort)
            if r.exit_status is None and r.state == "idle":
                try:
                    r.process.expect_exit()  # first: it may be gone before send returns
                    r.channel.send_bytes(stop_msg)
                except OSError:
                    torn = True
            elif r.exit_status is None:
                r.process.kill()
        if torn and self.remote:
            self.abort_remote()  # not a clean stop: the launcher must not wait for the others
        deadline = time.monotonic() + wait
        for r in self.ranks:
            if r.exit_status is None:
                r.process.join(max(0.0, deadline - time.monotonic()))
        kill_all(self.ranks)
        deadline = time.monotonic() + 0.5  # the last lines of every rank, all ranks together
        for r in self.ranks:
            self.relay.wait_closed(r.rank, max(0.0, deadline - time.monotonic()))
            r.state = "dead" if r.state == "dead" else "stopped"
        self._sel.close()
