"""``%dist_wait``'s progress bar: the steps a background job's ranks log, counted on the slowest
rank, with tqdm -- its widget in a notebook, its text bar in a console.

The bar is named after the job. Its total is unknown while the job runs (nothing tells the
kernel how many steps the ranks will take), so it counts up; when the job has ended, it is set to
the last step, and the bar ends full at ``N/N``. In a notebook the bar's widget is shown with a
display id and shown again at the end, so the text a saved notebook keeps for it (its
``text/plain``) is the final count, not the ``0 steps`` it began with.
"""
from __future__ import annotations

from typing import Optional

POLL_S = 0.3  #: how often the bar looks at the job's steps (seconds)


def steps_done(job) -> Optional[int]:
    """Steps the slowest rank has logged so far, counting from step 0 (``None``: none yet)."""
    steps = [s for s in job.metrics.last_step().values() if s is not None]
    return min(steps) + 1 if steps else None


def wait_with_bar(job) -> None:
    """Wait until ``job`` ends, showing a bar of its logged steps if it runs longer than
    :data:`POLL_S`, or until it pauses at a breakpoint (waiting on would last until someone
    attaches, from another cell). A ``KeyboardInterrupt`` ends the wait (the job goes on)."""
    if job.wait(POLL_S) or job.paused:
        return
    import sys

    from tqdm.auto import tqdm

    notebook = sys.modules.get("tqdm.notebook")  # imported by tqdm.auto in a kernel (ipywidgets)
    widget = notebook is not None and issubclass(tqdm, notebook.tqdm_notebook)
    bar = tqdm(desc=job.name, unit=" steps", **({"display": False} if widget else {}))
    handle = None
    if widget:
        from IPython.display import display

        handle = display(bar.container, display_id=True)
    try:
        while not job.wait(POLL_S) and not job.paused:  # paused: wait() returns at once
            _move(bar, steps_done(job))
        done = steps_done(job)  # every step the ranks logged arrived before the job's end
        _move(bar, done)
        if job.state == "done" and done:
            bar.total = done
            bar.refresh()
    finally:
        bar.close()
        if handle is not None:  # the saved notebook's text for the bar: its final state
            handle.update(bar.container)


def _move(bar, done: Optional[int]) -> None:
    if done is not None and done != bar.n:
        bar.n = done
        bar.refresh()
