"""Background jobs: a call that returns at once and runs on the ranks while the notebook goes on.

A :class:`Job` is a :class:`~nbdist.runtime.calls.Call` whose waiting happens on a thread of its
own (``nbdist-job-NAME``); when the ranks answer, the job takes the group's lock and settles the
call exactly as a blocking call would, so ``job.result()`` raises what the blocking call would have
raised. While it runs, the group refuses other calls with :class:`~nbdist.GroupBusyError`.
"""
from __future__ import annotations

import collections
import contextvars
import html
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..errors import GroupBusyError, JobPausedError
from ..report.units import bare_name
from . import rankpdb
from .calls import INTERRUPTED, OUTPUT_LINES, Call  # noqa: F401 -- OUTPUT_LINES: its old home
from .metrics import Metrics, format_value

#: every job started in this process (``g.submit``, ``%%dist --bg``, ``lightning.fit(block=False)``),
#: oldest first; the last 100 are kept. ``%dist_jobs``, ``%dist_wait`` and ``%dist_watch`` read it.
STARTED: "collections.deque[Job]" = collections.deque(maxlen=100)


class Job:
    """A call running in the background on a group's ranks (from :meth:`nbdist.Group.submit`,
    :meth:`nbdist.Group.submit_exec` or ``%%dist --bg``)."""

    def __init__(self, name: str, call: Call, finish: Callable[[], List[Any]]):
        self.name = name
        self.call = call
        self.metrics: Metrics = call.metrics  #: what the ranks logged so far (nbdist.log)
        #: per rank, every line printed so far, repeats included (the last 1000 per rank)
        self.output: Dict[int, List[str]] = call.output
        self.started = time.time()
        self.ended: Optional[float] = None
        self._finish = finish
        self._launched = False
        self._done = threading.Event()
        self._results: Optional[List[Any]] = None
        self._error: Optional[BaseException] = None
        context = contextvars.copy_context()  # output goes to the cell that started the job
        self._thread = threading.Thread(target=context.run, args=(self._run,),
                                        name=f"nbdist-job-{name}", daemon=True)

    def start(self) -> "Job":
        """Start waiting for the ranks (the request was already sent). Idempotent: the group
        calls it again if a Ctrl-C landed in the first call, so that the job always ends."""
        if not self._launched:
            try:
                self._thread.start()
            except RuntimeError:  # started by the call a Ctrl-C cut short
                pass
            self._launched = True
            STARTED.append(self)
        return self

    def _run(self) -> None:
        try:
            self._results = self._finish()
        except BaseException as err:  # noqa: BLE001 -- kept, raised by result()
            self._error = err
        finally:
            self.ended = time.time()
            self._done.set()

    def add_output(self, rank: int, text: str) -> None:
        """Keep what rank ``rank`` printed (the group's output router keeps it on the call)."""
        self.call.add_output(rank, text)

    # ---- state --------------------------------------------------------------------------------
    def done(self) -> bool:
        """True once the job finished (results, an error, or interrupted)."""
        return self._done.is_set()

    def running(self) -> bool:
        """True while the job runs."""
        return not self._done.is_set()

    @property
    def stalled(self):
        """While the job is stalled (nothing logged or printed, no collective completed for the
        group's ``stall`` seconds): where the ranks were then, a
        :class:`~nbdist.runtime.stacks.Stacks`; else ``None``. A stall kills nothing."""
        return self.call.stalled if not self.done() else None

    @property
    def paused(self) -> Optional[Dict[int, str]]:
        """While ranks of the job wait at a breakpoint: ``{rank: "file:line (function)"}``, else
        ``None``. Attach with :meth:`debug` (``%dist_debug NAME``); until then the job's timeout
        and stall watch are suspended, and nothing else is held up."""
        pauses = self.call.pauses
        return (pauses.where() or None) if pauses is not None and not self.done() else None

    @property
    def state(self) -> str:
        """``"running"``, ``"paused"`` (at a breakpoint), ``"stalled"``, ``"done"``, ``"failed"``
        or ``"interrupted"``."""
        if not self.done():
            if self.paused:
                return "paused"
            return "stalled" if self.call.stalled is not None else "running"
        if self._error is None:
            return "done"
        return INTERRUPTED if self.call.outcome == INTERRUPTED else "failed"

    @property
    def elapsed(self) -> float:
        """Seconds since the job started (until it ended, once it has)."""
        return (self.ended or time.time()) - self.started

    @property
    def error(self) -> Optional[BaseException]:
        """The error :meth:`result` raises, once the job has ended with one."""
        return self._error if self.done() else None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: until it ends); True if it has ended. While
        the job is :attr:`paused` at a breakpoint it returns False at once: it would wait until
        someone attaches (:meth:`debug`)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.paused:
            left = 0.1 if end is None else min(0.1, end - time.monotonic())
            if left <= 0 or self._done.wait(left):
                break
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> List[Any]:
        """The per-rank results, waiting for them; raises what a blocking call would have raised
        (``RemoteError``, ``RankDiedError``, ``DistTimeoutError``, ``GroupInterrupted``),
        ``TimeoutError`` if the job still runs after ``timeout`` seconds (it keeps running), or
        :class:`~nbdist.JobPausedError` while it is :attr:`paused` at a breakpoint."""
        if not self.wait(timeout):
            if self.paused:
                raise JobPausedError(rankpdb.paused_text(self), self)
            raise TimeoutError(f"job {self.name!r} is still running after {timeout:g} s; wait "
                               "longer, or stop it with job.interrupt()")
        if self._error is not None:
            raise self._error
        return self._results

    def debug(self, command: Optional[str] = None, rank: Optional[int] = None) -> str:
        """pdb on a rank of this job :attr:`paused` at a breakpoint (default: the first such
        rank), one command at a time, as :meth:`Group.debug <nbdist.Group.debug>` is post-mortem
        (what ``%dist_debug NAME`` runs): ``None`` returns what pdb printed before its prompt; a
        command (``p x``, ``n``, ``l``, ``where``...) runs there and returns what pdb printed
        next. ``c`` lets the job run on, ``q`` ends it with an error; both return ``""``. A
        ``LookupError`` says so when that rank is not at a breakpoint."""
        return rankpdb.attach(self, command, rank)

    def interrupt(self) -> None:
        """Stop the job as Ctrl-C stops a blocking call: the ranks get SIGINT; those still blocked
        after the group's grace period (inside a collective) are killed and the group must restart.
        Returns at once; :meth:`wait` for the end."""
        self.call.cancel()

    def end(self, timeout: float) -> None:
        """If the job still runs: :meth:`interrupt` it and wait up to ``timeout`` s for its end
        (what the group's ``stop()`` and ``restart()`` do first)."""
        if self.running():
            self.interrupt()
            self.wait(timeout)

    def busy_error(self) -> GroupBusyError:
        """The error a call on the group raises while this job runs."""
        return GroupBusyError(
            f"the group is busy with background job {self.name!r} (running {self.elapsed:.1f} s);"
            " wait for it with job.wait() or %dist_wait, or stop it with job.interrupt(). Calls "
            "are never queued behind a job.", self)

    # ---- display ------------------------------------------------------------------------------
    def describe(self) -> str:
        """One line: name, state, elapsed time, the last step of each rank."""
        steps = self.metrics.last_step()
        where = ", ".join(f"rank {r} step {s}" for r, s in sorted(steps.items()) if s is not None)
        slow = self.metrics.stragglers()
        note = "; ".join(f"straggler: rank {r} (compute {x:.2f}x the median)"
                         for r, x in slow.items())
        text = (f"job {self.name!r}: {self.state}, {self.elapsed:.1f} s"
                + (f" ({where})" if where else "") + (f"; {note}" if note else ""))
        stalled, since = self.call.stalled, self.call.stalled_since
        if self.paused:
            text += "; " + rankpdb.paused_text(self, short=True)
        elif stalled is not None and not self.done() and since is not None:
            quiet = min(time.time() - since, self.elapsed)
            text += (f"; no progress for {quiet:.1f} s (nothing logged or printed, "
                     f"no collective completed):\n{stalled.summary()}")
        return text

    def __repr__(self) -> str:
        text = f"<nbdist.Job {self.describe()}>"
        if len(self.metrics):
            text += "\n" + repr(self.metrics).split("\n", 1)[-1]
        return text

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))

    def _repr_html_(self) -> str:
        rows, steps = [], self.metrics.last_step()
        for rank, values in sorted(self.metrics.last().items()):
            cells = ", ".join(f"{html.escape(bare_name(n))} = {html.escape(format_value(n, v))}"
                              for n, (_, v) in values.items())
            step = steps.get(rank)
            rows.append(f"<tr><td>{rank}</td><td>{'' if step is None else step}</td>"
                        f"<td>{cells}</td></tr>")
        table = ("<table><thead><tr><th>rank</th><th>last step</th><th>last values</th></tr>"
                 f"</thead><tbody>{''.join(rows)}</tbody></table>") if rows else ""
        return (f"<div class='nbdist-job'><b>nbdist job</b> '{html.escape(self.name)}': "
                f"{html.escape(self.state)}, {self.elapsed:.1f} s{table}</div>")
