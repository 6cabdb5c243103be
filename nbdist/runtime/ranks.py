"""The caller's handles on its ranks: one :class:`Rank` each, whatever started its process
(:mod:`.processes`), and the :class:`RankSet` a call talks to.

A rank's state has one owner: the :class:`Rank` itself. Every change is one of its methods, and
:data:`MOVES` is the whole state machine::

    starting --ready()--> idle --begin()--> busy --replied() / settled()--> idle
        any state --died()--> dead          any state but dead --stopped()--> stopped

Who calls which -- once a rank belongs to a :class:`RankSet`, only the thread holding that set's
``ranks`` lock (:attr:`RankSet.lock`: the caller's in a call, a job's while it waits for its own
call, the teardown), which the test suite checks on every move: the accept loop (:mod:`.ready`)
``connected()`` and ``ready()``; a call
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
from typing import Any, Dict, Iterable, List, Optional

from ..errors import ExitStatus
from ..wire import locks, transport
from ..wire.deadline import Deadline
from ..wire.relay import OutputRelay
from .processes import Process, select_exits, watch_exits
from .reaper import reap_ranks
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
        self._guard = None  # its rank set's ``ranks`` lock, once it belongs to one
        self.cells: Dict[str, str] = {}  #: the notebook cells' texts sent to it (:mod:`.cells`)

    def __repr__(self) -> str:
        return f"<Rank {self.rank}: {self.state}{' ' + self.busy_with if self.busy_with else ''}>"

    @property
    def state(self) -> str:
        """``starting``, ``idle``, ``busy``, ``dead`` or ``stopped`` (changed only by the methods
        below)."""
        return self._state

    def _move(self, to: str) -> None:
        if isinstance(self._guard, locks.OrderedLock):  # the suite checks the threading model
            locks.require(self._guard, f"moved rank {self.rank} from {self._state!r} to {to!r}")
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


class RankSet:
    """The ranks of a running group as a call sees them: their control channels and sentinels in
    one selector, the lifelines, and the pooled result segments the caller gave back.

    Owned by the group from a successful start to its teardown; used by one call at a time.
    """

    def __init__(self, ranks: List[Rank], relay: OutputRelay, ends_survivors: bool = False):
        self.ranks = ranks
        self.relay = relay
        #: held by the one thread that reads the ranks' channels and moves their states (a call's,
        #: a job's while it waits, the teardown): :data:`nbdist.wire.locks.ORDER`'s ``ranks``
        self.lock = locks.make("ranks", reentrant=True)
        #: the teardown could not take :attr:`lock` in time: it killed the processes and left the
        #: rest (reaping, closing) to the thread that holds it (:meth:`retire`)
        self.orphaned = False
        for r in ranks:
            r._guard = self.lock
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
        if not self._polled:  # every exit is a sentinel in the selector (all but Windows)
            return [key.data for key, _ in self._sel.select(timeout)]
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
        while q is not None and not q.empty():  # (most calls: empty, no exception raised)
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

    def shutdown(self, deadline: Deadline) -> List[int]:
        """Ask the idle ranks to stop (they destroy their process group and exit), kill the
        others, reap every process by ``deadline`` -- those asked get up to :data:`ASKED_S` s of
        it to exit cleanly, then are killed too -- and close all (:mod:`.reaper`). Returns the
        ranks whose process could not be confirmed gone (a host that does not answer)."""
        if not self.lock.acquire(timeout=deadline.left() if deadline.at is not None else -1):
            self.orphaned = True  # another thread still reads the channels: kill, leave the rest
            self.kill(r.rank for r in self.ranks)
            return [r.rank for r in self.ranks]  # none reaped: that thread does it
        try:
            return self._shutdown(deadline)
        finally:
            self.lock.release()

    def retire(self) -> None:
        """(The thread that held :attr:`lock` when the teardown came.) Finish what the teardown
        left: reap, close (:meth:`shutdown`), if it was :attr:`orphaned`."""
        if self.orphaned:
            self.orphaned = False
            self.shutdown(Deadline(ASKED_S + STREAMS_S))

    def _shutdown(self, deadline: Deadline) -> List[int]:
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
        asked = Deadline.earliest(deadline, Deadline(ASKED_S))
        left = reap_ranks(self.ranks, deadline, asked=asked, relay=self.relay,
                          streams_s=STREAMS_S)  # the last lines, all ranks together
        for r in self.ranks:
            r.stopped()
        self._sel.close()
        return left


#: seconds the ranks asked to stop get to exit cleanly before they are killed
ASKED_S = 2.0
#: seconds the last lines of every rank get, all ranks together, once their processes ended
STREAMS_S = 0.5
