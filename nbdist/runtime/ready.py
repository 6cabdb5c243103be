"""Waiting until every rank is connected and has initialised torch.distributed: one loop for local
and attached ranks.

Every connection proves it holds the group key before anything it sends is read
(:func:`nbdist.wire.transport.server_handshake`). A rank connects three times: its stdout and
stderr (handed to the output relay; stderr is also its lifeline) and its control channel. What
differs between local and attached ranks -- which control connections are welcome, what to send
them, how to word a timeout -- is an :class:`Admission`.
"""
from __future__ import annotations

import selectors
import socket
import time
from typing import Any, Dict, List, Optional

import cloudpickle

from ..errors import (DistTimeoutError, ExitStatus, NbdistError, RankDiedError, RemoteError,
                      RemoteFailure, ranks_phrase)
from ..wire import transport
from ..wire.deadline import WAKE_S
from ..wire.relay import OutputRelay
from .advice import option
from .processes import select_exits, watch_exits
from .ranks import Rank
from .reader import Waiter, receive


class AdmissionStopped(NbdistError):
    """The admission was told to stop (its :attr:`Admission.wake` turned readable)."""


class Admission:
    """What a launcher decides while ranks join (the defaults suit ranks nbdist started)."""

    protect = False  #: seal every connection's messages (:mod:`nbdist.wire.seal`)
    #: a socket that turns readable when the ranks must not join after all (their group stopped):
    #: the wait then raises :class:`AdmissionStopped` at once
    wake: Optional[socket.socket] = None

    def control(self, hello: Dict[str, Any], channel: transport.Channel,
                ranks: Dict[int, Rank]) -> Optional[Rank]:
        """The rank a control connection belongs to, or ``None`` to refuse it."""
        r = ranks.get(int(hello["rank"]))
        return r if r is not None and r.channel is None else None

    def stream(self, hello: Dict[str, Any], role: str, relay: OutputRelay) -> bool:
        """Whether to relay this output stream."""
        return not relay.has(int(hello["rank"]), role)

    def timed_out(self, missing: List[int], ranks: Dict[int, Rank], timeout: float) -> str:
        """The message of the :class:`DistTimeoutError` raised when ranks are missing."""
        return (f"{ranks_phrase(missing)} did not finish starting within {timeout:.0f} s "
                f"(connected to the controller: "
                f"{[r for r, h in sorted(ranks.items()) if h.channel is not None]}). "
                f"Raise {option('init_timeout')}, or check the ranks' stderr above.")

    def joined(self, rank: Rank) -> None:
        """A rank's control channel was accepted (progress bars count here)."""


def accept_until_ready(listener: socket.socket, key: bytes, world_size: int,
                       ranks: Dict[int, Rank], relay: OutputRelay, timeout: float,
                       admission: Admission) -> List[Rank]:
    """Accept connections until all ``world_size`` ranks reported ready; return them in rank order.

    Raises (leaving the ranks to the caller to kill) :class:`DistTimeoutError` after ``timeout``
    seconds, :class:`RankDiedError` if a process exited while starting, or :class:`NbdistError`
    naming the ranks where ``init_process_group`` failed.
    """
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", -1))
    if admission.wake is not None:
        sel.register(admission.wake, selectors.EVENT_READ, ("wake", -1))
    polled = watch_exits(sel, ranks.values())  # sentinels, or polled exits on Windows
    deadline = time.monotonic() + timeout
    failures: Dict[int, RemoteFailure] = {}
    dead: Dict[int, tuple] = {}
    start = Start(ranks, failures, dead)
    try:
        while (len(ranks) < world_size or any(r.state != "idle" for r in ranks.values())) \
                and not failures and not dead:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in range(world_size)
                           if r not in ranks or ranks[r].state != "idle"]
                raise DistTimeoutError(admission.timed_out(missing, ranks, timeout), missing)
            # (at most WAKE_S at a time: a Ctrl-C the OS gave another thread acts)
            for (what, idx), fileobj in select_exits(sel, polled, min(remaining, WAKE_S)):
                if what == "dead" and idx in dead:
                    continue
                if what == "wake":
                    raise AdmissionStopped("told to stop while ranks were joining")
                if what == "listen":
                    _accept(listener, key, world_size, ranks, relay, sel, admission)
                elif what == "ctl":
                    _on_control(ranks[idx], sel, start)
                else:
                    ranks[idx].process.join(1.0)
                    dead[idx] = (ranks[idx].exit_status, "")
                    if fileobj is not None:
                        sel.unregister(fileobj)
    finally:
        sel.close()
    if failures or dead:
        raise_start_failure(list(ranks.values()), failures, dead, relay)
    return [ranks[r] for r in range(world_size)]


def _accept(listener, key, world_size, ranks, relay, sel, admission: Admission) -> None:
    conn, _ = listener.accept()
    try:
        hello, seal = transport.accept_session(conn, key, 5.0, admission.protect)
        rank, role = int(hello["rank"]), hello["role"]
        if not 0 <= rank < world_size or role not in ("control", "stdout", "stderr"):
            raise transport.AuthenticationError(f"unexpected hello {hello!r}")
        if role == "control":
            channel = transport.Channel(conn, seal)
            r = admission.control(hello, channel, ranks)
            if r is None:
                raise transport.AuthenticationError("control connection refused")
        elif not admission.stream(hello, role, relay):
            raise transport.AuthenticationError("stream refused")
    except (transport.AuthenticationError, KeyError, ValueError, TypeError):
        conn.close()  # refuse quietly: nothing the peer sent was interpreted
        return
    if role != "control":
        relay.add(rank, role, conn, seal)
        return
    r.connected(channel)
    ranks[rank] = r
    sel.register(conn, selectors.EVENT_READ, ("ctl", rank))
    admission.joined(r)


class Start(Waiter):
    """What the one reader (:mod:`.reader`) hands the start-up of ranks: each rank's one message,
    ``"ready"`` or ``"init_err"``, or its loss. There is no rank set yet (``rs`` is ``None``)."""

    def __init__(self, ranks: Dict[int, Rank], failures: Dict[int, RemoteFailure],
                 dead: Dict[int, tuple]):
        super().__init__()
        self.ranks, self.failures, self.lost = ranks, failures, dead

    def lose(self, rs, r: int) -> None:
        """Rank ``r``'s channel failed while it started: it is dead (or lost with its host)."""
        super().lose(rs, r)
        rank = self.ranks[r]
        rank.process.join(1.0)
        self.lost[r] = (rank.exit_status or ExitStatus(lost=True, where=rank.process.where,
                                                       why=rank.channel.failure), "")

    def reply(self, rs, r: int, seq: int, status: str, body: Any, paths) -> None:
        """(No request was sent yet: nothing answers one.)"""

    def pdb(self, rs, r: int, seq: int, body: Any) -> None:
        """(No request runs yet: no breakpoint can be hit.)"""

    def ready(self, rs, r: int, info: Any) -> None:
        """Rank ``r`` initialised torch.distributed."""
        self.ranks[r].ready(info)

    def init_failed(self, rs, r: int, body: Any) -> None:
        """Rank ``r`` could not initialise torch.distributed."""
        self.failures[r] = failure_from(body)


def _on_control(r: Rank, sel, start: Start) -> None:
    receive(start, None, r.rank, r.channel)  # one message: ready, a failure, or none (lost)
    sel.unregister(r.channel.sock)


def raise_start_failure(ranks: List[Rank], failures: Dict[int, RemoteFailure],
                        dead: Dict[int, tuple], relay: OutputRelay) -> None:
    """Turn what went wrong while starting into one error naming every rank concerned."""
    if dead:
        for idx in dead:
            relay.wait_closed(idx, 1.0)
            dead[idx] = (dead[idx][0], relay.tail(idx))
        raise RankDiedError(dead, "while starting (before torch.distributed was initialised).",
                            "Nothing was left running; fix the cause and start the group again.")
    err = RemoteError(failures)
    absent = [r for r in ranks if r.state != "idle" and r.rank not in failures]
    why = "".join(
        f" Rank {r.rank} never got there ("
        + (f"still alive, pid {r.pid}: stuck before or inside the rendezvous"
           if r.exit_status is None else r.exit_status.describe()) + ")."
        for r in absent)
    raise NbdistError(f"torch.distributed could not be initialised on {ranks_phrase(failures)}: "
                      f"{err.root_cause.type_name}: {err.root_cause.message}.{why}") from err


def failure_from(body: Dict[str, Any]) -> RemoteFailure:
    """Rebuild a :class:`RemoteFailure` from a worker's error report."""
    exc = None
    if body.get("exception") is not None:
        try:
            exc = cloudpickle.loads(body["exception"])
        except Exception:  # noqa: BLE001 -- an exception class we cannot import here
            exc = None
    return RemoteFailure(body["rank"], body["type"], body["message"], body["traceback"],
                         body["time"], exc)
