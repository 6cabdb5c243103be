"""What a background job's ranks print, under the cell that started it, in a saved notebook too.

A stream message (``print``) that arrives after its cell has ended is shown by JupyterLab under
that cell, but a headless run (nbclient, ``jupyter nbconvert --execute``, and so every executed
or rendered tutorial) drops it: it only keeps messages for the cell running at that moment. A
display that the starting cell made, with a display id, can be updated from anywhere. So, in a
kernel, ``%load_ext nbdist`` sets :data:`nbdist.runtime.output.JOB_DISPLAY` to
:class:`JobOutput`: each background job shows (empty at first) a display under the cell that
started it, and its lines -- labelled and folded as any call's -- are added to it as they come,
each update sent twice, as the live view's figure is: in the starting cell's context (JupyterLab
routes it there) and in no cell's (ipykernel then names the cell running at that moment, and
nbclient applies an update it receives under the running cell to every output with that id).
"""
from __future__ import annotations

import collections
import contextvars
import html
import threading
import time
import weakref

from ..wire import locks

MAX_LINES = 500  #: lines the display keeps (the latest); ``job.output`` keeps every rank's
EVERY = 0.2  #: at most this often (seconds) the display is sent again while lines keep coming


class JobOutput:
    """The display of one job's output: call it as ``show(stream, text)`` with rendered lines."""

    def __init__(self, name: str):
        from IPython.display import display

        self.name = name
        self._lines: "collections.deque[tuple]" = collections.deque(maxlen=MAX_LINES)
        self._count = 0
        self._lock = locks.make("display")
        self._sent = 0.0
        self._timer = None
        self._context = contextvars.copy_context()  # the cell that started the job
        self._handle = display({"text/plain": ""}, raw=True, display_id=True)

    def __call__(self, stream: str, text: str) -> None:
        with self._lock:
            for line in text.splitlines():
                self._lines.append((stream, line))
                self._count += 1
            wait = self._sent + EVERY - time.monotonic()
            if wait > 0:  # sent a moment ago: once more when the moment is over
                if self._timer is None:
                    self._timer = threading.Timer(wait, self.flush)
                    self._timer.name, self._timer.daemon = f"nbdist-job-output-{self.name}", True
                    self._timer.start()
                return
        self.flush()

    def flush(self) -> None:
        """Send the display's current text (both ways, see the module's docstring)."""
        with self._lock:
            self._timer, self._sent = None, time.monotonic()
            bundle = self.bundle()
            self._context.run(self._handle.update, bundle, raw=True)
            contextvars.Context().run(self._handle.update, bundle, raw=True)

    def bundle(self) -> dict:
        """The display's text (``text/plain``) and the same with stderr lines marked (HTML)."""
        dropped = self._count - len(self._lines)
        head = (f"(the {dropped} earlier lines: {self.name}.output has each rank's last "
                "1000)\n" if dropped else "")
        plain = head + "".join(f"{line}\n" for _, line in self._lines)
        marked = "".join(
            f"<span style='background: var(--jp-rendermime-error-background, #fdd)'>"
            f"{html.escape(line)}</span>\n" if stream == "stderr" else f"{html.escape(line)}\n"
            for stream, line in self._lines)
        return {"text/plain": plain,
                "text/html": f"<pre class='nbdist-job-output'>{html.escape(head)}{marked}</pre>"}


class JobStatus:
    """The job itself, as a ``%%dist --bg`` cell shows it in a kernel: a display with an id (not
    the cell's ``Out[]``, which would keep "running, 0.0 s" for good), sent again when the job
    has ended -- by ``%dist_wait`` and by the job's live view -- both ways, as :class:`JobOutput`,
    so a saved notebook shows how the job ended."""

    def __init__(self, job):
        from IPython.display import display

        self.job = job
        self._context = contextvars.copy_context()  # the cell that started the job
        self._handle = display(job, display_id=True)
        _STATUS[job] = self

    def flush(self) -> None:
        """Send the job's display as it is now (both ways)."""
        self._context.run(self._handle.update, self.job)
        contextvars.Context().run(self._handle.update, self.job)


_STATUS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # job -> its JobStatus


def finish(job) -> None:
    """Send ``job``'s displays once more, from the cell running now: ``%dist_wait`` calls it
    when the job has ended, so a headless run keeps every line (one sent while no cell ran is
    lost) and the job's own display says how it ended."""
    show = getattr(job.call, "show", None)
    if isinstance(show, JobOutput):
        show.flush()
    finish_status(job)


def finish_status(job) -> None:
    """Send the display of ``job`` that its ``%%dist --bg`` cell made again, if it made one (the
    live view calls it when the job has ended)."""
    status = _STATUS.get(job)
    if status is not None:
        status.flush()


def show_job(job):
    """What ``%%dist --bg`` shows: in a kernel (where the job's output has its display), the job
    in a :class:`JobStatus` display, returning ``None``; elsewhere the job itself, as the cell's
    value."""
    if isinstance(getattr(job.call, "show", None), JobOutput):
        JobStatus(job)
        return None
    return job


def job_display(name: str) -> JobOutput:
    """What :data:`nbdist.runtime.output.JOB_DISPLAY` is set to in a kernel."""
    return JobOutput(name)
