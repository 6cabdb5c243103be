"""How a call travels: one request to the chosen ranks, a wait on replies and sentinels, and one
outcome handled by one teardown policy.

A :class:`Call` owns everything about one request: its sequence number, targets, deadline, and
what came back (``pending``, ``replies``, ``dead``). :meth:`Call.wait` ends in exactly one outcome:

* ``"ok"`` -- every target replied (with a result, or a Python error: :class:`RemoteError`; an
  error that left a rank's process group unusable -- torch's timeout or backend error, reported
  by the worker -- also breaks the group);
* ``"died"`` -- a worker process died (the sentinel fires, or its channel broke);
* ``"timeout"`` -- the deadline passed;
* ``"interrupted"`` -- the caller got Ctrl-C / the notebook's interrupt (while sending, too).

:func:`settle` turns the outcome into a :class:`Verdict`: the results, or the error to raise, and
whether the group must be torn down. Ranks still busy after a timeout or an interrupt get SIGINT;
those still blocked after ``grace`` seconds (inside a collective, typically) are killed. A rank that
died is reported after the survivors had a moment to answer. In an attached group (ranks started by
torchrun/srun) a death or a kill also ends every other rank (:meth:`RankSet.abort_remote`), and the
error says so. A Ctrl-C that lands once every rank has replied (while the results are unpickled)
loses this call's results only: the group stays usable, and the error says so. The call never
touches the group's state: the group applies the verdict. A background job is the same object,
waited on later.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..errors import (DistTimeoutError, GroupInterrupted, RankDiedError, RemoteError,
                      RemoteFailure, hint_for, ranks_phrase)
from ..wire import pool, serialize, transport
from ..wire.deadline import WAKE_S, Deadline, poll_until
from . import cells, rankpdb, recorder, stacks
from .metrics import Metrics
from .ranks import RankSet
from .reader import Waiter, read
from .failure_advice import attached_advice, dead_group_advice, gone_advice
from .ready import failure_from

OK, DIED, TIMEOUT, INTERRUPTED = "ok", "died", "timeout", "interrupted"
#: what a reply that lent no pooled segment claims while it is unpickled: nothing
_NOTHING_LENT = contextlib.nullcontext(())
OUTPUT_LINES = 1000  #: lines of output a call keeps per rank (the oldest are dropped beyond)


class Call(Waiter):
    """One request to ``targets``, from send to outcome; what the reader of the ranks' channels
    waits for while it runs (:class:`~nbdist.runtime.reader.Waiter`)."""

    def __init__(self, seq: int, kind: str, payload: Any, targets: List[int],
                 timeout: Optional[float], what: str):
        super().__init__()
        self.seq, self.targets, self.timeout, self.what = seq, list(targets), timeout, what
        self.msg = transport.encode((kind, seq, payload))
        #: the text of the notebook cells its code comes from, sent first to a rank that lacks it
        self.cells: Dict[str, str] = {}
        self.deadline: Optional[float] = None
        self.started: Optional[float] = None
        self.pending: set = set()
        self.replies: Dict[int, tuple] = {}
        self.outcome: Optional[str] = None
        self.metrics = Metrics()  #: what the ranks logged with nbdist.log during the call
        self.output: Dict[int, List[str]] = {}  #: per rank, every line printed (repeats too)
        #: lines printed so far, all ranks (only :meth:`add_output` writes it): what another
        #: thread counts instead of iterating :attr:`output`, which the relay thread grows
        self.lines = 0
        #: a breakpoint on a rank prompts in the notebook (a blocking call in the main thread);
        #: else (a background job) pdb is told to continue (:mod:`.rankpdb`)
        self.interactive = threading.current_thread() is threading.main_thread()
        self.debugged: set = set()  #: ranks whose pdb prompted in this call
        self.pauses: Optional[rankpdb.Pauses] = None  #: a job's ranks at a breakpoint
        #: where the ranks were when the call was last seen stalled (``None``: not stalled)
        self.stalled = None
        self.stalled_since: Optional[float] = None
        #: where the lines shown for this call go, ``show(stream, text)`` (``None``: the caller's
        #: sys.stdout / sys.stderr); a background job's, from :data:`.output.JOB_DISPLAY`
        self.show = None
        self._cancelled = False

    def add_output(self, rank: int, text: str) -> None:
        """Keep what rank ``rank`` printed (the last :data:`OUTPUT_LINES` lines per rank)."""
        lines = self.output.setdefault(rank, [])
        new = text.splitlines()
        lines.extend(new)
        del lines[:-OUTPUT_LINES]
        self.lines += len(new)

    def send(self, rs: RankSet) -> None:
        """Send the request to every target (a rank whose channel fails is caught by the wait).

        A Ctrl-C while sending ends the call as ``interrupted`` here (:meth:`wait` then returns at
        once): the ranks that got the request are interrupted as usual, one whose request was
        cut in half (a torn channel) is killed, those not reached yet never knew of the call.
        """
        self.started = time.time()
        if self.timeout is not None:
            self.deadline = time.monotonic() + self.timeout
        sent, before = set(), {}
        try:
            for r in self.targets:
                rank = rs[r]
                rank.begin(self.what, self.started)
                self.pending.add(r)  # before sending: an interrupted send leaves a torn channel
                try:
                    freed = rs.take_freed(r)
                    if freed:
                        rank.channel.send_bytes(transport.encode(("free", 0, freed)))
                    cells.send_missing(rank, self.cells)
                    before[r] = rank.channel.sent
                    rank.channel.send_bytes(self.msg)
                except OSError:
                    pass  # the sentinel (or EOF) tells the rest
                sent.add(r)
        except KeyboardInterrupt:
            self.outcome = INTERRUPTED
            sent |= {r for r, n in before.items() if rs[r].channel.sent > n}  # its last byte went
            for r in self.pending - sent:  # its request had not started: it is not in the call
                if not rs[r].channel.torn:
                    self.pending.discard(r)
                    rs[r].settled()

    def poll(self, rs: RankSet, timeout: Optional[float]) -> None:
        """Read what has arrived within ``timeout`` seconds: replies, deaths, broken channels,
        and whatever else the ranks sent (:mod:`.reader`)."""
        read(rs, timeout, self)

    # ---- what the reader hands this call (the thread waiting on it) ----------------------------
    def lose(self, rs: RankSet, r: int) -> None:
        """Rank ``r`` died or its channel broke: dead to this call, and no longer watched."""
        self.dead.add(r)
        rs.forget(r)

    def reply(self, rs: RankSet, r: int, seq: int, status: str, body: Any, paths) -> None:
        """Rank ``r``'s reply to request ``seq``: this call's, or a late one nobody will read."""
        if seq == self.seq and r in self.pending:
            self.pending.discard(r)
            self.replies[r] = (status, body, paths)
            rs[r].replied()
        else:
            rs.release(r, paths)

    def log(self, rs: RankSet, r: int, seq: int, rows: Any) -> None:
        """Rows rank ``r`` logged with ``nbdist.log``: this call's metrics."""
        if seq == self.seq:
            self.metrics.add(rows)

    def pdb(self, rs: RankSet, r: int, seq: int, body: Any) -> None:
        """A breakpoint on rank ``r`` waits for a command (:func:`.rankpdb.answer`)."""
        if seq == self.seq:
            rankpdb.answer(self, rs, r, body, self.interactive)
        else:
            super().pdb(rs, r, seq, body)

    def cancel(self) -> None:
        """Ask the waiting thread to end the call as interrupted (any thread; see ``tick``)."""
        self._cancelled = True
        if self.pauses is not None:  # a paused job is paused no more: it is being stopped
            self.pauses.stopping = True

    def wait(self, rs: RankSet, tick: Optional[float] = None, on_tick=None) -> str:
        """Block until the outcome is known; return it (also kept in :attr:`outcome`).

        ``tick``: wake at least this often to notice :meth:`cancel` (background jobs), and call
        ``on_tick()`` each time (a job's stall watch, :class:`~nbdist.runtime.stacks.StallWatch`);
        at most :data:`~nbdist.wire.deadline.WAKE_S` (a SIGINT the OS gave another thread is
        raised here within that). While a rank of a job waits at a breakpoint (:attr:`pauses`),
        the deadline waits too.
        """
        if self.outcome is not None:  # interrupted while sending
            return self.outcome
        try:
            while self.pending and not self.dead:
                if self._cancelled:
                    self.outcome = INTERRUPTED
                    if self.pauses is not None:  # ranks at a breakpoint leave pdb (q)
                        self.pauses.quit_all()
                    return self.outcome
                if self.pauses is not None:  # a rank at a breakpoint: the deadline waits
                    self.pauses.hold(self)
                remaining = None if self.deadline is None else self.deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self.outcome = TIMEOUT
                    return self.outcome
                step = WAKE_S if tick is None else min(tick, WAKE_S)
                self.poll(rs, step if remaining is None else min(remaining, step))
                if on_tick is not None:
                    on_tick()
        except KeyboardInterrupt:
            self.outcome = INTERRUPTED
            return self.outcome
        self.outcome = DIED if self.dead else OK
        return self.outcome


@dataclass
class Verdict:
    """What a settled call means for the caller and for the group."""

    results: Optional[List[Any]] = None
    error: Optional[BaseException] = None
    broken: bool = False  #: the group must be torn down (``restart()`` brings it back)


def settle(call: Call, rs: RankSet, grace: float, auto_restart: bool,
           world_size: int) -> Verdict:
    """The one teardown policy: turn a call's outcome into a :class:`Verdict`."""
    if call.outcome == OK:
        return _decode(call, rs, world_size, auto_restart)
    if call.outcome == DIED:
        return Verdict(error=_deaths(call, rs, auto_restart), broken=True)
    waiting = sorted(call.pending)
    where = stacks.at_timeout(call, rs, waiting, world_size) if call.outcome == TIMEOUT else None
    killed, torn = _stop_pending(call, rs, grace)
    ended = (rs.abort_remote() if killed else []) if rs.ends_survivors else None
    stopped = [r for r in waiting if r not in killed]
    after = _after_stop_text(killed, torn, grace, auto_restart, ended, rs, stopped)
    if call.outcome == TIMEOUT:
        seen = f"\nWhere they were when the time ran out:\n{where.summary()}" if where else ""
        error: BaseException = DistTimeoutError(
            f"{ranks_phrase(waiting)} still running after {call.timeout:g} s; {after}{seen}",
            waiting, where)
    else:
        error = GroupInterrupted(f"interrupted {ranks_phrase(waiting)}; {after}",
                                 sorted(set(waiting) - set(killed)), killed)
    return Verdict(error=error, broken=bool(killed))


def lost_results(call: Call, when: str) -> GroupInterrupted:
    """The error of a call interrupted after every rank replied (``when``: "while ..."): the
    ranks are idle and keep their variables; only the results of this call are gone."""
    return GroupInterrupted(f"interrupted {when}: the ranks had finished the call and the group "
                            "is still usable (variables on the ranks are kept), but this call's "
                            "results are lost; run it again.")


def _stop_pending(call: Call, rs: RankSet, grace: float):
    """SIGINT the ranks still busy, wait ``grace``, kill the rest; return the killed ranks and,
    among them, those whose channel was torn.

    A rank whose channel holds half a message (the interrupt hit mid-send or mid-read) cannot be
    talked to any more: it is killed at once. A second interrupt cuts the grace short.
    """
    torn = {r for r in call.pending if rs[r].channel.torn}
    for r in torn:
        rs.forget(r)
    call.dead |= torn
    for r in call.pending - torn:
        rs.interrupt(r, call.seq)  # the worker's watchdog delivers SIGINT to its main thread
    try:
        poll_until(lambda: not call.pending - call.dead, lambda left: call.poll(rs, left),
                   Deadline(grace))
    except KeyboardInterrupt:
        pass  # interrupted again: stop waiting, kill what is left
    for r, (_, _, paths) in call.replies.items():
        rs.release(r, paths)  # the caller raises: these results are dropped
    killed = sorted(call.pending | call.dead)
    rs.kill(killed)
    for rank in rs.ranks:
        rank.settled()
    return killed, sorted(torn)


def _after_stop_text(killed: List[int], torn: List[int], grace: float, auto_restart: bool,
                     ended: Optional[List[int]], rs: RankSet, stopped: List[int]) -> str:
    if not killed:
        return "stopped on SIGINT; the group is still usable."
    how = "it restarts on the next call (auto_restart)" if auto_restart else \
        "call restart() to bring it back"
    if ended is not None:  # an attached group: the others were told to exit
        how = attached_advice([r for r in ended if r not in killed], rs)
    stuck = [r for r in killed if r not in torn]
    why = [f"{ranks_phrase(stopped)} stopped on SIGINT"] if stopped else []
    if torn:
        many = len(torn) > 1
        why.append(f"{ranks_phrase(torn)} {'were' if many else 'was'} killed: the interrupt came "
                   f"while {'their' if many else 'its'} request was half sent (or a reply half "
                   "read), and a torn channel cannot carry another message")
    if stuck:
        why.append(f"{ranks_phrase(stuck)} did not react within {grace:g} s (blocked inside a "
                   f"collective?) and {'were' if len(stuck) > 1 else 'was'} killed")
    return f"{'; '.join(why)}; the group is broken: {how}."


def _deaths(call: Call, rs: RankSet, auto_restart: bool) -> RankDiedError:
    # Survivors blocked in a collective with the dead rank fail within ~30 ms (gloo): wait a
    # moment for their replies, so their state is known, then report.
    poll_until(lambda: not call.pending - call.dead, lambda left: call.poll(rs, left),
               Deadline(1.0))
    # a rank whose control channel closed is dead, even if its stderr has not said so yet
    ended = rs.abort_remote(call.dead) if rs.ends_survivors else []
    dead = [r for r in sorted(call.dead) if r not in ended] or sorted(call.dead)
    deaths = {}
    gone = Deadline(1.0)  # every dead rank's exit and last lines: one wait for them all
    for r in dead:
        rs[r].process.join(gone.left())
    for r in dead:
        rs.relay.wait_closed(r, gone.left())
        deaths[r] = (rs[r].exit_status, rs.relay.tail(r))
        rs[r].died()
    tails = " ".join(t for _, t in deaths.values())
    advice = ""
    if rs.ends_survivors:
        text = attached_advice([r for r in ended if r not in deaths], rs)
        advice = ("The group failed. " + (text if text.startswith("nbdist") else
                                          f"{text[0].upper()}{text[1:]}") + ".")
    elif auto_restart:  # not "call restart()": the next call does it
        advice = ("The group was shut down; it restarts on the next call (auto_restart; "
                  "per-rank variables are lost).")
    return RankDiedError(deaths, hint_for(tails) or "", advice)


def _decode(call: Call, rs: RankSet, world_size: int, auto_restart: bool) -> Verdict:
    results: List[Any] = []
    failures: Dict[int, RemoteFailure] = {}
    dead_group = False  # a rank's process group failed: no collective can work any more
    gone: List[int] = []  # failed ranks left without a default process group
    todo = sorted(call.replies)
    claimed: List[str] = []  # the pooled segments unpickled so far of the reply being read
    try:
        while todo:
            r = todo[0]
            status, body, paths = call.replies[r]
            if status != "ok":
                dead_group = dead_group or bool(body.get("pg_failed"))
                if body.get("pg_gone"):
                    gone.append(r)
                failures[r] = failure_from(body)
                rs[r].failed(f"{failures[r].type_name}: {failures[r].message}")
                results.append(None)
                todo.pop(0)
                continue
            with pool.claiming() if paths else _NOTHING_LENT as claimed:
                try:
                    results.append(serialize.loads(body))
                except Exception as err:  # noqa: BLE001 -- e.g. a class only the ranks import
                    # Segments rebuilt before the failure are given back by their tensors'
                    # finalizers; those never reached must be given back here, or the rank
                    # never reuses them.
                    rs.release(r, [p for p in paths or () if p not in claimed])
                    failures[r] = RemoteFailure(
                        r, type(err).__name__, f"the result of rank {r} could not be unpickled "
                        f"here: {err}", f"{type(err).__name__}: {err}\n", time.time())
                    results.append(None)
            todo.pop(0)
    except KeyboardInterrupt:  # every rank replied: only these results are lost, not the group
        for i, r in enumerate(todo):  # segments of replies never unpickled go back to the ranks
            rs.release(r, [p for p in call.replies[r][2] or () if i or p not in claimed])
        return Verdict(error=lost_results(
            call, f"while the results of '{call.what}' were unpickled here"))
    for r, failure in failures.items():  # ranks torchrun/srun started: say where they ran
        failure.where = rs[r].process.where
    if failures:  # the collective each raised in, as the ranks' recorders saw it
        seen = recorder.failed_in({r: call.replies[r][1].get("collective") for r in failures
                                   if isinstance(call.replies[r][1], dict)})
        advice = dead_group_advice(call, rs, world_size, auto_restart) if dead_group else \
            gone_advice(gone)
        return Verdict(error=RemoteError(failures, results, world_size, advice, seen),
                       broken=dead_group)
    return Verdict(results=results)
