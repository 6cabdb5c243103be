"""The caller's handles on its ranks: one :class:`Rank` each, whatever started its process
(:mod:`.processes`), and the :class:`RankSet` a call talks to.

A rank's state has one owner: the :class:`Rank` itself. Every change is one of its methods, and
:data:`MOVES` is the whole state machine::

    starting --ready()--> idle --begin()--> busy --replied() / settled()--> idle
        any state --died()--> dead          any state but dead --stopped()--> stopped

Who calls which (all on the thread that holds the group: the caller's, or a job's for its own
call): the accept loop (:mod:`.ready`) ``connected()`` and ``ready()``; a call
(:mod:`.calls`) ``begin()``, ``replied()``, ``settled()`` (a rank not reached by an interrupted
send, or left after an interrupt) and ``died()``; the group's teardown (:meth:`RankSet.shutdown`)
``stopped()``; a failed reply ``failed()``; an attached group's next generation (:mod:`.generations`)
``of_generation()``. Other threads (``status()``, the launcher panel) only read.

A failed attached group ends its remote ranks itself (:meth:`RankSet.abort_remote`): the moment one
rank's lifeline closes unexpectedly -- or a call ends in a death, or a rank is killed -- every other
remote rank is told to exit with :data:`~nbdist.wire.relay.ABORT_EXIT_CODE`, even one blocked inside
a collective (its watchdog thread exits the process). torchrun then ends the job with a failure
(or restarts it, with ``--max-restarts``) instead of holding the nodes. Whether a group's ranks are
ended so is its launcher's word (``Launcher.ends_survivors``), handed to the :class:`RankSet`.
"""
from __future__ import annotations

import queue
import selectors
import time
from typing import Any, Dict, Iterable, List, Optional

from ..errors import ExitStatus
from ..wire import locks, transport
from ..wire.relay import OutputRelay
from .processes import Process, select_exits, watch_exits
from .stacks import StacksBox

#: A rank's states, each with the states it may move to (the one state machine; see above).
MOVES = {
    "starting": ("idle", "dead", "stopped"),
    "idle": ("busy", "dead", "stopped"),
    "busy": ("idle", "dead", "stopped"),
    "dead": ("dead",),
    "stopped": ("dead", "stopped"),
}


class Rank:
    """The caller's handle on one rank: its process, its control channel, and its state, which
    only the methods below change (see :data:`MOVES`)."""

    def __init__(self, rank: int, process: Process,
                 channel: Optional[transport.Channel] = None):
        self.rank, self.process, self.channel = rank, process, channel
        self.info: Optional[Dict[str, Any]] = None  #: what the rank reported when ready
        self._state = "starting"
        self.busy_with = ""  #: what the call in flight runs (``"busy"`` only)
        self.since: Optional[float] = None  #: when that call started (wall clock)
        self.last_error = ""  #: the last Python error the rank replied with
        self.generation = 1  #: 2, 3, ... for ranks torchrun restarted (attached groups)
        self.cells: Dict[str, str] = {}  #: the notebook cells' texts sent to it (:mod:`.cells`)

    def __repr__(self) -> str:
        return f"<Rank {self.rank}: {self.state}{' ' + self.busy_with if self.busy_with else ''}>"

    @property
    def state(self) -> str:
        """``starting``, ``idle``, ``busy``, ``dead`` or ``stopped`` (changed only by the methods
        below)."""
        return self._state

    def _move(self, to: str) -> None:
        if to not in MOVES[self._state]:
            raise RuntimeError(f"nbdist internal error: rank {self.rank} cannot go from "
                               f"{self._state!r} to {to!r}")
        self._state = to

    # ---- the transitions --------------------------------------------------------------------
    def connected(self, channel: transport.Channel) -> None:
        """Its control connection was accepted (while ``starting``; the first one counts)."""
        if self.channel is None:
            self.channel = channel

    def ready(self, info: Dict[str, Any]) -> None:
        """It reported torch.distributed initialised: ``starting`` -> ``idle``."""
        self._move("idle")
        self.info = info

    def begin(self, what: str, when: float) -> None:
        """A call's request goes to it: ``idle`` -> ``busy`` with ``what`` since ``when``."""
        self._move("busy")
        self.busy_with, self.since = what, when

    def replied(self) -> None:
        """Its reply to the call arrived: ``busy`` -> ``idle``."""
        self._move("idle")
        self.busy_with, self.since = "", None

    def settled(self) -> None:
        """The call is over for it without a reply (never reached by an interrupted send, or
        interrupted and then killed or given up on): ``busy`` -> ``idle``; no-op otherwise."""
        if self.state == "busy":
            self.replied()

    def died(self) -> None:
        """Its process is gone without being asked to (any state -> ``dead``)."""
        self._move("dead")
        self.busy_with, self.since = "", None

    def stopped(self) -> None:
        """The group's teardown ended it (``dead`` stays ``dead``)."""
        if self.state != "dead":
            self._move("stopped")
            self.busy_with, self.since = "", None

    def failed(self, text: str) -> None:
        """It replied with a Python error (kept for ``status()``; the state does not change)."""
        self.last_error = text

    def of_generation(self, generation: int) -> None:
        """It belongs to an attached group's ``generation`` (torchrun restarted the ranks)."""
        self.generation = generation

    # ---- what it is -------------------------------------------------------------------------
    @property
    def pid(self) -> Optional[int]:
        """The worker's process id (on its own host)."""
        return self.process.pid

    @property
    def exit_status(self) -> Optional[ExitStatus]:
        """``None`` while the process runs."""
        status = self.process.exit_status
        why = self.channel.failure if self.channel is not None else ""
        if why and status is not None:  # its connection refused a message: that is the cause
            return ExitStatus(lost=True, where=self.process.where, why=why)
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

    def __init__(self, ranks: List[Rank], relay: OutputRelay, ends_survivors: bool = False):
        self.ranks = ranks
        self.relay = relay
        self._freed: Dict[int, "queue.SimpleQueue[str]"] = {r.rank: queue.SimpleQueue()
                                                            for r in ranks}
        self.aborted: List[int] = []  #: remote ranks told to exit because the group failed
        self._abort_lock = locks.make("abort", reentrant=True)  # the relay's hook re-enters
        self._in_hook = False
        #: a failed call ends the other ranks (they were started elsewhere: ``abort_remote``)
        self.ends_survivors = ends_survivors
        if ends_survivors:
            relay.on_close = self._lifeline_closed
        self.stacks = StacksBox()  #: the ranks' answers to stack requests (:mod:`.stacks`)
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

    def interrupt(self, r: int, seq: int) -> bool:
        """Interrupt request ``seq`` on rank ``r`` through its lifeline."""
        lifeline = self.relay.lifeline(r)
        return lifeline is not None and lifeline.interrupt(seq)

    def kill(self, ranks: Iterable[int]) -> None:
        """SIGKILL these ranks (without waiting)."""
        for r in ranks:
            self.ranks[r].process.kill()

    def _lifeline_closed(self, r: int) -> None:
        """(Relay thread.) A remote rank's connection ended: unless we asked for it, the group
        has failed -- its collectives can never complete -- so end the other remote ranks now."""
        if self._in_hook or not 0 <= r < len(self.ranks) or \
                self.ranks[r].process.ended_by_us:
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
                if r.rank in dead or (r.channel is not None and r.channel.failure):
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
        if torn and self.ends_survivors:
            self.abort_remote()  # not a clean stop: the launcher must not wait for the others
        deadline = time.monotonic() + wait
        for r in self.ranks:
            if r.exit_status is None:
                r.process.join(max(0.0, deadline - time.monotonic()))
        kill_all(self.ranks)
        deadline = time.monotonic() + 0.5  # the last lines of every rank, all ranks together
        for r in self.ranks:
            self.relay.wait_closed(r.rank, max(0.0, deadline - time.monotonic()))
            r.stopped()
        self._sel.close()
