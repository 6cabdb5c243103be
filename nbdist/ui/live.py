"""The live view of a background job: ``nbdist.ui.watch(job)`` / ``%dist_watch [NAME]``.

It shows, under the cell that asked for it, a status line and an Interrupt button (ipywidgets) and
a figure (:func:`nbdist.ui.plots.metrics.live_figure`, 10 in wide): when the ranks time their
steps with ``nbdist.step``, first each rank's step split into compute and communication
(stacked bars, stragglers named, and what a fast rank's communication then is: waiting for the
slow one), then every scalar the ranks log in a grid (one panel per scalar, a line per rank,
times in one unit per panel); while the job is stalled, the figure says so above, with where the
ranks are (the stacks' summary), as the status line does. It is redrawn in place at
most every ``every`` seconds while the job runs -- from a thread of its own, so the notebook stays
usable. The figure is a plain PNG output updated through its display id: when the job ends, the
last one stays in the notebook as a static image, and a saved notebook shows the final state.
Beyond :data:`nbdist.ui.plots.metrics.MAX_POINTS` points per rank and scalar the curves are thinned
(the panel's title says so), so drawing stays quick whatever the length of the run.
"""
from __future__ import annotations

import base64
import contextvars
import html
import io
import threading
import time
import weakref
from typing import Optional

MIN_EVERY = 0.5  #: the view never redraws more often than this (seconds)
_views: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # job -> its live views


def finish_views(job, timeout: float = 30.0) -> None:
    """Wait until every live view of ``job`` (which has ended) has drawn its final figure:
    ``%dist_wait`` calls it, so the figure a saved notebook keeps is the job's last state."""
    for view in list(_views.get(job, ())):
        view.join(timeout)


class Watch:
    """A live view of one job; :func:`watch` makes and shows it."""

    def __init__(self, job, every: float = MIN_EVERY):
        import ipywidgets as widgets

        if every < MIN_EVERY:
            raise ValueError(f"every must be at least {MIN_EVERY} s (the view redraws at most "
                             f"twice a second), got {every!r}")
        self.job, self.every = job, float(every)
        self.status = widgets.HTML(self._status_html())
        self.button = widgets.Button(description="Interrupt", button_style="warning",
                                     tooltip="stop the job as Ctrl-C would")
        self.button.on_click(lambda _: self.job.interrupt())
        self.controls = widgets.HBox([self.button, self.status])
        self.redraws = 0
        self._drawn = (-1, None)
        self._handle = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def show(self) -> "Watch":
        """Display the controls and the figure, then keep them current until the job ends."""
        from IPython.display import display

        display(self.controls)
        self._handle = display(self._figure_bundle(), raw=True, display_id=True)
        # Each update goes out twice (it names its display id: applying it twice changes nothing):
        # in this cell's context, which JupyterLab routes to this cell's output area, and in the
        # thread's own, which names the cell running at that moment, as nbclient (and so saved and
        # rendered notebooks) expects.
        self._context = contextvars.copy_context()
        self._thread = threading.Thread(target=self._loop, name=f"nbdist-watch-{self.job.name}",
                                        daemon=True)
        _views.setdefault(self.job, weakref.WeakSet()).add(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop redrawing (the job goes on)."""
        self._stop.set()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the view's last redraw (after the job ended)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        # Redraws start ``every`` s apart, so a value waits at most that plus one render; but a
        # render slower than half of it is followed by half of it idle: the kernel stays usable.
        began = time.monotonic()
        from matplotlib.figure import Figure  # noqa: F401 -- imported now, not in the 1st redraw

        while not self._stop.is_set():
            until = time.monotonic() + max(self.every - (time.monotonic() - began),
                                           self.every / 2)
            ended = self.job.wait(until - time.monotonic())
            if not ended:  # wait() returns at once while the job is paused at a breakpoint
                self._stop.wait(max(0.0, until - time.monotonic()))
            began = time.monotonic()
            self.refresh()
            if ended:
                from .joboutput import finish_status

                finish_status(self.job)  # the --bg cell's display of the job: how it ended
                break
        self.button.disabled = True
        self.button.layout.display = "none"  # a saved notebook shows no button for a job ended

    def refresh(self) -> None:
        """Redraw now if anything changed since the last redraw."""
        state = (len(self.job.metrics), self.job.state)
        if state != self._drawn and self._handle is not None:
            self._drawn = state
            bundle = self._figure_bundle()
            self._context.run(self._handle.update, bundle, raw=True)
            self._handle.update(bundle, raw=True)
            self.redraws += 1
        self.status.value = self._status_html()  # after the figure: the two agree

    def _status_html(self) -> str:
        return ("<span class='nbdist-watch-status' style='white-space: pre-wrap'>"
                f"{html.escape(self.job.describe())}</span>")

    def _note(self) -> Optional[str]:
        """For the figure, while the job is stalled: since when, and where the ranks are."""
        stalled = self.job.stalled
        since = None if stalled is None else self.job.call.stalled_since
        if since is None:
            return None
        quiet = min(time.time() - since, self.job.elapsed)
        return (f"stalled: nothing logged or printed and no collective completed for "
                f"{quiet:.0f} s (nothing was killed); where the ranks are:\n{stalled.summary()}")

    def figure(self):
        """The figure as the view draws it now (a ``matplotlib.figure.Figure``), or ``None``
        while nothing was logged."""
        if not len(self.job.metrics):
            return None
        from .plots.metrics import live_figure

        return live_figure(self.job.metrics, note=self._note())

    def _figure_bundle(self) -> dict:
        text = repr(self.job)
        fig = self.figure()
        if fig is None:
            return {"text/plain": text + "\n(nothing logged yet: nbdist.log on the ranks)"}
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        return {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"), "text/plain": text}


def watch(job, every: float = MIN_EVERY) -> Watch:
    """Show a live view of ``job`` (from ``g.submit`` or ``%%dist --bg``) under this cell: status,
    Interrupt button, and per-rank curves of what the ranks log, redrawn at most every ``every``
    seconds while it runs; the final figure stays when it ends."""
    return Watch(job, every).show()
