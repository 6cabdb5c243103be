"""How a :class:`~nbdist.runtime.group.Group` runs one call under its lock, from check to verdict,
and how a background job ends: the calls half of the group (:class:`Dispatch`, mixed into it).

A blocking call: :meth:`~Dispatch._begin` (check, mark busy), send, wait, :meth:`~Dispatch._end`
(settle, apply the verdict to the group, show the output), and :meth:`~Dispatch._leave`, which
makes sure that however the call ended -- a Ctrl-C between two steps included -- the group is not
left "busy". A Ctrl-C lands where it lands:

* while sending: the call ends "interrupted" (see :meth:`Call.send <nbdist.runtime.calls.Call.send>`);
* while waiting: the same, the ranks are interrupted;
* once every rank replied (unpickling the results, showing the output): the group stays usable and
  only this call's results are lost (:func:`~nbdist.runtime.calls.lost_results`);
* anywhere else: the group is torn down (``restart()`` brings it back).

A job is published on the group only once its request is on the ranks, and its thread always
starts, so a job that can never end never holds the group. Its thread settles the call as a
blocking call would -- unless the group was stopped or restarted meanwhile.
"""
from __future__ import annotations

import contextvars
from typing import Any, List, Optional

from ..errors import GroupClosedError, GroupInterrupted, RemoteError
from ..wire import segments
from . import rankpdb, requests, stacks
from .calls import Call, lost_results, settle
from .jobs import Job


class Dispatch:
    """The part of :class:`~nbdist.runtime.group.Group` that runs calls and jobs. It reads and
    writes the group's ``_state``, ``_rs``, ``_inc``, ``_out``, ``_job``, ``_last_call`` and
    ``_stop_requested`` under the group's ``_lock``, and leaves launching and tearing down to
    the group (``_launch``, ``_shutdown``, ``_teardown``)."""

    def _check_usable(self) -> None:
        if self.job is not None:
            raise self.job.busy_error()
        if self._state == "stopped":
            raise GroupClosedError("this group was stopped; start a new one with nbdist.start() "
                                   "or call restart() on it.")
        if self._state == "broken":
            if self._launcher.can_relaunch(self._opts["auto_restart"]):
                self._shutdown()
                self._launch()
                return
            raise GroupClosedError("this group is broken after an earlier failure (see the error "
                                   f"above); {self._launcher.broken_advice}")

    def stacks(self, all_threads: bool = False, ranks=None, timeout: float = 5.0):
        """Each rank's current Python stack -- the main thread's, every thread's with
        ``all_threads`` -- as a :class:`~nbdist.runtime.stacks.Stacks` (printed with ranks that
        share a stack folded together). The rank's watchdog thread takes it, so it works while
        the rank is busy: in a background job, in a hung collective, in a blocking call seen from
        another thread, on attached ranks. A rank that does not answer within ``timeout`` s shows
        as "no answer". ``ranks``: which ranks to ask (default all)."""
        targets = requests.targets(ranks, self.world_size)
        # The lock first, then the ranks: held, nobody else reads the channels, and the ranks
        # read are those the lock guards (not a set a restart replaced meanwhile). Not held, a
        # call runs and its thread reads them; its ranks are read once, as status() reads them.
        read = self._lock.acquire(blocking=False)
        held = None  # the rank set whose lock this thread took (the job thread holds a busy one)
        try:
            if read and self.job is not None:  # the job's thread reads them: let it
                self._lock.release()
                read = False
            rs, state = self._rs, self._state
            if rs is None or state not in ("ready", "busy"):
                raise GroupClosedError(f"this group is {state}: it has no running ranks to "
                                       "take stacks from; call restart() (or nbdist.start()) "
                                       "first.")
            if read:
                if rs.lock.acquire(blocking=False):
                    held = rs
                else:  # another thread waits on these ranks and reads their channels
                    self._lock.release()
                    read = False
            n, asked = stacks.ask(rs, targets, all_threads)
            got = stacks.collect(rs, n, asked, timeout, read)
        finally:
            if held is not None:
                held.lock.release()
            if read:
                self._lock.release()
        return stacks.Stacks({r: got.get(r) for r in targets}, self.world_size)

    def debug(self, command: Optional[str] = None, rank: int = 0) -> str:
        """Post-mortem pdb on ``rank``: run one pdb ``command`` (``p x``, ``up``, ``l``, ``where``
        ...) on the traceback of the rank's last failed call, which the rank keeps until its
        next call; return what pdb printed. ``None`` starts: the exception and the line that
        raised it. What ``%dist_debug`` runs, one prompt at a time. (A background job paused at
        a breakpoint has its own, live: :meth:`Job.debug <nbdist.Job.debug>`.)"""
        return self._call(requests.debug_request(command), [rank], None)[0]

    def _begin(self, req: requests.Request, ranks, timeout) -> Call:
        """Under the lock: check, make the call, mark busy (nothing sent yet)."""
        targets = requests.targets(ranks, self.world_size)
        self._check_usable()
        timeout = requests.check_timeout(timeout if timeout is not None
                                         else self._opts["call_timeout"])
        call = self._last_call = Call(next(self._seq), req.kind, req.payload, targets, timeout,
                                      req.what)
        call.cells = req.cells
        self._inc.relay.context = contextvars.copy_context()
        self._out.begin(call)
        self._state = "busy"
        return call

    def _send(self, call: Call) -> None:
        try:
            with self._rs.lock:
                call.send(self._rs)
        except BaseException:
            self._teardown()
            raise

    def _end(self, call: Call) -> List[Any]:
        """Under the lock, once the call's outcome is known: the one teardown policy, applied.
        The group's state is settled before the call's output is shown: a Ctrl-C from then on
        loses this call's results, never the group."""
        try:
            with self._rs.lock:  # the ranks' states move: the rank set's holder does it
                verdict = settle(call, self._rs, self._opts["grace"],
                                 self._opts["auto_restart"], self.world_size)
        except BaseException:
            self._teardown()  # something unforeseen mid-call: no channel can be trusted
            self._out.finish(call, None, wait=False)
            raise
        stopped = self._stop_requested
        if verdict.broken or stopped:
            self._teardown()
        else:
            self._state = "ready"
        try:  # what the call printed: held lines, the summary of repeats; a sink got every line
            self._out.finish(call, getattr(self._inc, "relay", None), wait=verdict.error is None
                             or isinstance(verdict.error, RemoteError))  # (not for a death)
        except KeyboardInterrupt as err:
            if verdict.error is None:
                raise lost_results(call, f"while the output of '{call.what}' was shown") from err
        if stopped:
            raise GroupClosedError(
                f"this group was stopped (stop() from another thread) while '{call.what}' ran "
                "on its ranks; they were killed. Start a new group, or restart() "
                "this one.") from verdict.error
        if verdict.error is not None:
            raise verdict.error
        return verdict.results

    def _leave(self, call: Call) -> None:
        """However a call ended -- a Ctrl-C or an error between two of its steps included -- the
        group is not left "busy": "ready" if none of its ranks still runs it, else torn down."""
        if self._state != "busy":
            return
        rs = self._rs
        if rs is not None and not self._stop_requested and not any(
                rs[r].state == "busy" or rs[r].channel.torn for r in call.targets):
            self._state = "ready"
        else:
            self._teardown()

    def _call(self, req: requests.Request, ranks, timeout) -> List[Any]:
        answered = False  # every target rank answered: they are done with the request's segments
        try:
            with self._lock:
                call = self._begin(req, ranks, timeout)
                try:
                    self._send(call)
                    with self._rs.lock:
                        call.wait(self._rs)  # at once if the send was interrupted
                    results = self._end(call)
                    answered = True
                    return results
                finally:
                    self._leave(call)
        finally:
            segments.let_go(req.segments, answered)

    def _submit(self, req: requests.Request, ranks, timeout, name: str) -> Job:
        with self._lock:
            call = None
            try:
                call = self._begin(req, ranks, timeout)
                call.interactive = False  # nothing answers a prompt in the background
                self._out.show_job(call, name)  # before any line can come
                rs = self._rs
                call.pauses = rankpdb.Pauses(rs, call.seq)  # a breakpoint pauses the job
                job = Job(name, call, lambda: self._finish_job(call, rs, req, name))
                self._send(call)
                if call.outcome is not None:  # a Ctrl-C while sending: settled here, no job
                    self._end(call)  # raises: an interrupted call's verdict is GroupInterrupted
            except BaseException:
                if call is not None:
                    self._leave(call)
                segments.remove_segments(req.segments)
                raise
            try:  # published only now: a job whose request never left could never end
                self._job = job
                job.start()
            except KeyboardInterrupt as err:  # the request is on the ranks: stop the job there
                job.interrupt()
                raise GroupInterrupted(
                    f"interrupted as background job '{name}' started: its request had reached "
                    "the ranks, so the job is stopped there as job.interrupt() does (%dist_jobs "
                    "lists it).", call.targets) from err
            finally:
                job.start()  # whatever landed above, the job's thread settles the call
            return job

    def _finish_job(self, call: Call, rs, req: requests.Request, name: str) -> List[Any]:
        """(A job's thread.) Wait for the ranks without the lock, then settle as a call would --
        unless the group was stopped or restarted meanwhile: those ranks are gone."""
        answered = False
        try:
            lost = None
            try:
                stall = self._opts.get("stall")
                watch = stacks.StallWatch(call, rs, stall) if stall else None
                with rs.lock:  # not the group's: a stop takes this one to shut the ranks down
                    call.wait(rs, tick=0.1, on_tick=watch.tick if watch else None)
            except Exception as err:  # noqa: BLE001 -- the ranks failed under it? see below
                lost = err
            with self._lock:
                rs.retire()  # a stop that came meanwhile killed them and left the rest to us
                if self._rs is not rs:  # never settle against other ranks, or none
                    how = ("stopped while job '{}' ran; its ranks were stopped with it. Start a "
                           "new group, or restart() this one." if self._state == "stopped" else
                           "restarted while job '{}' ran; its ranks were replaced.")
                    raise GroupClosedError("the group was " + how.format(name)) from lost
                if lost is not None:
                    self._teardown()
                    raise lost
                results = self._end(call)
                answered = True
                return results
        finally:
            call.pauses.end()  # nobody can attach any more
            segments.let_go(req.segments, answered)
