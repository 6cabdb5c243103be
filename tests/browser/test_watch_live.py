"""The live view in JupyterLab, in headless Chromium (issue 17): run tutorial 8, see the figure of
a background job change between two screenshots while it runs, the notebook answer meanwhile, and
the job's output stay under the cell that started it."""
from __future__ import annotations

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


@pytest.mark.timeout(150)
def test_the_live_view_changes_while_the_job_runs(jupyterlab, page, artifacts):
    page.set_default_timeout(30_000)
    page.goto(f"{jupyterlab.url}/lab/workspaces/w{uuid.uuid4().hex[:8]}/tree/{NOTEBOOK}"
              f"?reset&token={jupyterlab.token}")
    page.wait_for_function(OPEN, timeout=60_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    watch, bg = _index(page, "%dist_watch job"), _index(page, "%%dist --bg job")
    assert watch > bg > 0
    cell = page.locator(".jp-Notebook .jp-Cell").nth(watch)
    first = page.wait_for_function(FIGURE_SRC, arg=watch, timeout=60_000).json_value()
    cell.scroll_into_view_if_needed()
    cell.screenshot(path=str(artifacts / "watch-1.png"))
    deadline, second = time.monotonic() + 30, first
    while second == first and time.monotonic() < deadline:
        time.sleep(0.3)
        second = page.evaluate(FIGURE_SRC, watch)
    cell.screenshot(path=str(artifacts / "watch-2.png"))
    assert second != first, "the live view's figure did not change while the job ran"
    page.wait_for_function(OPEN, timeout=90_000)  # every cell ran
    bg_text = page.locator(".jp-Notebook .jp-Cell").nth(bg).text_content()
    assert "[rank 0] first step done" in bg_text and "[rank 1] first step done" in bg_text
    free = page.locator(".jp-Notebook .jp-Cell").nth(_index(page, "sum(range(10))"))
    assert "the kernel is free: 45" in free.text_content()
    status = cell.locator(".nbdist-watch-status").text_content()
    assert "done" in status and "straggler: rank 1" in status
    cell.screenshot(path=str(artifacts / "watch-final.png"))
    print(f"\nscreenshots: {artifacts / 'watch-1.png'}, watch-2.png, watch-final.png")
