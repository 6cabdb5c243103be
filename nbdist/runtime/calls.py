"""How a call travels: one request to every chosen rank, then a wait on replies and sentinels.

:class:`CallEngine` is the part of :class:`nbdist.Group` that sends a request, collects the replies
and turns whatever happens meanwhile into one clear outcome:

* every rank replied: results in rank order, or :class:`RemoteError` with the remote tracebacks;
* a worker process died: :class:`RankDiedError` at once (the sentinel fires), after the survivors
  had a moment to report, and the group is torn down;
* the deadline passed, or the caller was interrupted: the busy ranks get SIGINT, those still
  blocked after ``grace`` seconds (inside a collective, typically) are killed, and
  :class:`DistTimeoutError` / :class:`GroupInterrupted` says which ranks were which.
"""
from __future__ import annotations

import contextvars
import queue
import time
from typing import Any, Dict, List, Optional

from ..wire import serialize, transport
from ..wire.segments import remove_segments
from . import launcher
from ..errors import (DistTimeoutError, GroupInterrupted, RankDiedError, RemoteError, ranks_phrase,
                     RemoteFailure, hint_for)


class CallEngine:
    """Request/reply over the control channels, with faults mapped to nbdist's errors.

    Relies on the group's ``_lock``, ``_ranks``, ``_sel``, ``_pump``, ``_opts``, ``_seq``,
    ``_state``, ``_targets``, ``_check_usable`` and ``_shutdown``.
    """

    def _call(self, kind: str, payload: Any, ranks, timeout, what: str, segments=()) -> List[Any]:
        try:
            with self._lock:
                targets = self._targets(ranks)
                self._check_usable()
                timeout = timeout if timeout is not None else self._opts["call_timeout"]
                if timeout is not None and (isinstance(timeout, bool) or timeout <= 0):
                    raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
                seq = next(self._seq)
                msg = transport.encode((kind, seq, payload))
                self._pump.context = contextvars.copy_context()
                self._state = "busy"
                try:
                    replies = self._collect(targets, seq, timeout, msg, what)
                except (DistTimeoutError, GroupInterrupted, RankDiedError):
                    raise
                except BaseException:
                    self._break()  # something unforeseen mid-call: no channel can be trusted
                    raise
                self._state = "ready"
                return self._decode(replies)
        finally:
            remove_segments(segments)

    def _send(self, targets: List[int], msg: bytes, what: str, pending: set) -> None:
        now = time.time()
        for r in targets:
            rank = self._ranks[r]
            rank.state, rank.busy_with, rank.since = "busy", what, now
            pending.add(r)  # before sending: an interrupted send leaves a torn channel
            try:
                freed = self._take_freed(r)
                if freed:
                    rank.channel.send_bytes(transport.encode(("free", 0, freed)))
                rank.channel.send_bytes(msg)
            except OSError:
                pass  # the sentinel (or EOF) tells the rest

    def _collect(self, targets: List[int], seq: int, timeout: Optional[float], msg: bytes,
                 what: str) -> Dict[int, tuple]:
        pending: set = set()
        replies: Dict[int, tuple] = {}
        dead: set = set()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._send(targets, msg, what, pending)
            while pending and not dead:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    waiting = sorted(pending)
                    killed = self._stop_pending(pending, replies, seq)
                    raise DistTimeoutError(
                        f"{ranks_phrase(waiting)} "
                        f"still running after {timeout:g} s; {self._after_stop_text(killed)}",
                        waiting)
                self._poll(remaining, pending, replies, dead, seq)
        except KeyboardInterrupt:
            waiting = set(pending)
            killed = self._stop_pending(pending, replies, seq)
            raise GroupInterrupted(
                f"interrupted {ranks_phrase(waiting)}; {self._after_stop_text(killed)}",
                sorted(waiting - set(killed)), killed) from None
        if dead:
            self._on_death(dead, pending, replies, seq)
        return replies

    def _poll(self, timeout, pending, replies, dead, seq) -> None:
        for key, _ in self._sel.select(timeout):
            what, r = key.data
            rank = self._ranks[r]
            if r in dead:
                continue
            if what == "dead":
                dead.add(r)
                self._forget(r)
                continue
            try:
                status, s, body, paths = rank.channel.recv()
            except Exception:  # noqa: BLE001 -- EOF, reset, or a corrupt stream: the rank is lost
                dead.add(r)
                self._forget(r)
                continue
            if s == seq and r in pending:
                pending.discard(r)
                replies[r] = (status, body, paths)
                rank.state, rank.since = "idle", None
            else:
                self._release(r, paths)  # a late reply nobody will read

    def _forget(self, r: int) -> None:
        """Stop watching rank ``r`` (it died, or its channel is torn): no busy loop on its fds."""
        rank = self._ranks[r]
        for obj in (rank.channel.sock, rank.process.sentinel):
            if obj is not None:
                try:
                    self._sel.unregister(obj)
                except (KeyError, ValueError, OSError):
                    pass

    def _take_freed(self, r: int) -> List[str]:
        freed, out = self._freed.get(r), []
        while freed is not None:
            try:
                out.append(freed.get_nowait())
            except queue.Empty:
                break
        return out

    def _release(self, r: int, paths) -> None:
        """Give pooled result segments back to rank ``r`` (their reply was never unpickled)."""
        for path in paths or ():
            self._freed[r].put(path)

    def _stop_pending(self, pending: set, replies: dict, seq: int) -> List[int]:
        """SIGINT the ranks still busy, wait ``grace``, kill the rest; return the killed ranks.

        A rank whose channel holds half a message (the interrupt hit mid-send or mid-read) cannot
        be talked to any more: it is killed at once. A second interrupt cuts the grace short.
        """
        dead = {r for r in pending if self._ranks[r].channel.torn}
        for r in dead:
            self._forget(r)
        for r in pending - dead:
            self._pump.send(r, b"I")  # the worker's watchdog delivers SIGINT to its main thread
        deadline = time.monotonic() + self._opts["grace"]
        try:
            while pending - dead and time.monotonic() < deadline:
                self._poll(max(0.0, deadline - time.monotonic()), pending, replies, dead, seq)
        except KeyboardInterrupt:
            pass  # interrupted again: stop waiting, kill what is left
        for r, (_, _, paths) in replies.items():
            self._release(r, paths)  # the caller raises: these results are dropped
        killed = sorted(pending | dead)
        if killed:
            for r in killed:
                self._ranks[r].process.kill()
            self._break()
        for r in self._ranks:
            if r.state == "busy":
                r.state = "idle"
        self._state = "broken" if killed else "ready"
        return killed

    def _after_stop_text(self, killed: List[int]) -> str:
        if not killed:
            return "stopped on SIGINT; the group is still usable."
        how = "it restarts on the next call (auto_restart)" if self._opts["auto_restart"] else \
            "call restart() to bring it back"
        return (f"{ranks_phrase(killed)} did not "
                f"react within {self._opts['grace']:g} s (blocked inside a collective?) and "
                f"{'were' if len(killed) > 1 else 'was'} killed; the group is broken: {how}.")

    def _on_death(self, dead: set, pending: set, replies: dict, seq: int) -> None:
        # Survivors blocked in a collective with the dead rank fail within ~30 ms (gloo): wait a
        # moment for their replies, so their state is known, then tear everything down.
        deadline = time.monotonic() + 1.0
        survivors = pending - dead
        while survivors and time.monotonic() < deadline:
            more: set = set()
            self._poll(max(0.0, deadline - time.monotonic()), survivors, replies, more, seq)
            dead |= more
            survivors -= more
        deaths = {}
        for r in sorted(dead):
            self._ranks[r].process.join(1.0)
            self._pump.wait_eof(r, 1.0)
            deaths[r] = (self._ranks[r].exitcode, self._pump.tail(r))
            self._ranks[r].state = "dead"
        self._break()
        tails = " ".join(t for _, t in deaths.values())
        raise RankDiedError(deaths, hint_for(tails) or "")

    def _break(self) -> None:
        """Tear the whole group down after a failure; ``restart()`` brings it back."""
        for r in self._ranks:
            if r.state == "busy":
                r.process.kill()
        self._shutdown()
        self._state = "broken"

    def _decode(self, replies: Dict[int, tuple]) -> List[Any]:
        results: List[Any] = []
        failures: Dict[int, RemoteFailure] = {}
        for r in sorted(replies):
            status, body, _ = replies[r]
            if status == "ok":
                try:
                    results.append(serialize.loads(body))
                    continue
                except Exception as err:  # noqa: BLE001 -- e.g. a class only the ranks can import
                    failures[r] = RemoteFailure(
                        r, type(err).__name__, f"the result of rank {r} could not be unpickled "
                        f"here: {err}", f"{type(err).__name__}: {err}\n", time.time())
            else:
                failures[r] = launcher.failure_from(body)
                self._ranks[r].last_error = f"{failures[r].type_name}: {failures[r].message}"
            results.append(None)
        self._pump.drain(flush_partial=True)
        if failures:
            raise RemoteError(failures, results, self.world_size)
        return results
