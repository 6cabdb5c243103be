"""The live view in JupyterLab, in headless Chromium (issue 17): run tutorial 8, see the figure of
a background job change between two screenshots while it runs, the notebook answer meanwhile, and
the job's output stay under the cell that started it and appear under no other cell.

The tutorial's job (120 steps) can end here within a couple of seconds of the view's first figure
-- about one redraw, as a figure takes 0.6-1.2 s to render on this machine -- so the test's copy
trains for up to 1,500 steps (20-40 s): long enough for several redraws whatever the load. Once
the test has seen the figure change, it ends the loop early (a file the copy's loop looks for):
the rest of the run was ranks and redraws burning CPU for nothing. The first screenshot must show
the job running, so the figures compared are both from while it ran.
"""
from __future__ import annotations

import json
import time
import uuid

import pytest

NOTEBOOK = "08_watch_live.ipynb"

OPEN = """() => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const s = w && w.sessionContext;
    return !!(w && w.context && w.context.path === %r && s && s.session && s.session.kernel
              && s.session.kernel.status === 'idle');
}""" % NOTEBOOK

ALL_RAN = """() => {
    const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
    return prompts.length > 0 && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
}"""

OUTPUTS = """() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')].map(c =>
    [...c.querySelectorAll('.jp-OutputArea-output')].map(o => o.textContent).join('\\n'))"""

FIGURE_SRC = """(index) => {
    const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[index];
    const img = cell && cell.querySelector('.jp-OutputArea-output img');
    return img && img.complete && img.naturalWidth > 100 ? img.getAttribute('src') : null;
}"""


def _index(page, text):
    """The position (among all cells) of the first cell whose source contains ``text``."""
    return page.evaluate("""(text) => [...document.querySelectorAll('.jp-Notebook .jp-Cell')]
        .findIndex(c => (c.querySelector('.jp-InputArea') || c).textContent.includes(text))""",
                         text)


LOOP = "    for step in range(steps):\n"
# Both ranks must leave at the same step (one left alone in DDP's all_reduce would wait out the
# group's timeout): the ranks agree on the file's existence, every step.
STOP_CHECK = """\
        seen = torch.tensor([float(__import__("os").path.exists({path!r}))])
        torch.distributed.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
        if seen.item():
            break
"""


def _longer(path, stop, steps=1500):
    """The copy's background cell trains for up to ``steps`` steps instead of the tutorial's 120,
    and its loop ends early, on both ranks at the same step, once the file ``stop`` exists (so the
    job runs only as long as the test needs it to)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    cell = next(c for c in nb["cells"] if "".join(c["source"]).startswith("%%dist --bg job"))
    assert "".join(cell["source"]) == "%%dist --bg job\ntrain()"
    cell["source"] = f"%%dist --bg job\ntrain({steps})"
    cell = next(c for c in nb["cells"] if "def train(" in "".join(c["source"]))
    source = "".join(cell["source"])
    assert source.count(LOOP) == 1
    cell["source"] = source.replace(LOOP, LOOP + STOP_CHECK.format(path=str(stop)))
    path.write_text(json.dumps(nb), encoding="utf-8")


@pytest.mark.timeout(240)
def test_the_live_view_changes_while_the_job_runs(jupyterlab, page, artifacts):
    stop = jupyterlab.root / "STOP"
    _longer(jupyterlab.root / NOTEBOOK, stop)
    page.set_default_timeout(30_000)
    page.goto(f"{jupyterlab.url}/lab/workspaces/w{uuid.uuid4().hex[:8]}/tree/{NOTEBOOK}"
              f"?reset&token={jupyterlab.token}")
    page.wait_for_function(OPEN, timeout=60_000)
    # not awaited: the command's promise settles only once every cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    watch, bg = _index(page, "%dist_watch job"), _index(page, "%%dist --bg job")
    assert watch > bg > 0
    cell = page.locator(".jp-Notebook .jp-Cell").nth(watch)
    first = page.wait_for_function(FIGURE_SRC, arg=watch, timeout=60_000).json_value()
    cell.scroll_into_view_if_needed()
    cell.screenshot(path=str(artifacts / "watch-1.png"))
    assert "running" in cell.locator(".nbdist-watch-status").text_content()
    deadline, second = time.monotonic() + 30, first
    while second == first and time.monotonic() < deadline:
        time.sleep(0.3)
        second = page.evaluate(FIGURE_SRC, watch)
    running = "running" in cell.locator(".nbdist-watch-status").text_content()
    cell.screenshot(path=str(artifacts / "watch-2.png"))
    assert second != first, "the live view's figure did not change while the job ran"
    assert running, "the job ended before the figure changed: no update seen while it ran"
    stop.touch()  # seen: the job's loop ends at its next step
    page.wait_for_function(ALL_RAN, timeout=150_000)  # every cell ran (and the job ended)
    bg_text = page.locator(".jp-Notebook .jp-Cell").nth(bg).text_content()
    # both ranks print it: shown once, labelled with both (quiet ranks), or once per rank
    assert ("[ranks 0, 1] first step done" in bg_text
            or "[rank 0] first step done" in bg_text and "[rank 1] first step done" in bg_text)
    # ... and only there: not under the cells that ran while the job printed (the live view,
    # "the kernel is free", %dist_jobs, %dist_wait) nor anywhere else
    outputs = page.evaluate(OUTPUTS)
    elsewhere = [i for i, text in enumerate(outputs) if i != bg and "first step done" in text]
    assert elsewhere == [], [outputs[i] for i in elsewhere]
    free = page.locator(".jp-Notebook .jp-Cell").nth(_index(page, "print(\"the kernel is free:\""))
    assert "the kernel is free: 45" in free.text_content()
    status = cell.locator(".nbdist-watch-status").text_content()
    assert "done" in status and "straggler: rank 1" in status
    cell.screenshot(path=str(artifacts / "watch-final.png"))
    print(f"\nscreenshots: {artifacts / 'watch-1.png'}, watch-2.png, watch-final.png")
