"""The widgets tutorial in JupyterLab, in headless Chromium: what a user sees and clicks.

Open ``notebooks/07_widgets.ipynb``, run all cells, press Start on the launcher and wait until
every rank shows idle, see the ranks busy while a call runs, run the benchmark panel and wait for its figure, run the memory panel and
move its world-size slider, choose an unavailable backend (refused, with the reason), then the
custom ``nbstore`` and press Restart, then Stop. A screenshot of each stage is kept in
``artifacts/browser/`` (the path is printed).
"""
from __future__ import annotations

import time
import uuid

import pytest
from playwright.sync_api import expect

NOTEBOOK = "07_widgets.ipynb"

KERNEL_IDLE = """() => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const s = w && w.sessionContext;
    return !!(w && w.context && w.context.path === %r && s && s.session && s.session.kernel
              && s.session.kernel.status === 'idle');
}""" % NOTEBOOK

RANKS = """([n, state, backend]) => {
    const cells = [...document.querySelectorAll('.nbdist-launcher td.nbdist-col-state')];
    const group = document.querySelector('.nbdist-launcher .nbdist-group');
    return cells.length === n && cells.every(c => c.dataset.state === state)
        && group.dataset.backend === backend;
}"""

FIGURE = """(selector) => {
    const img = document.querySelector(selector);
    return !!(img && img.complete && img.naturalWidth > 100);
}"""


def no_errors(page):
    """No panel shows an error."""
    expect(page.locator(".nbdist-error")).to_have_count(0)


@pytest.mark.timeout(150)
def test_widgets_tutorial_in_jupyterlab(jupyterlab, page, artifacts):
    try:
        walk_through(jupyterlab, page, artifacts)
    except Exception:
        path = artifacts / "failed.png"
        page.screenshot(path=str(path), full_page=True)
        panels = [p.text_content() for p in page.locator(".nbdist-feedback").all()]
        print(f"\nat the failure: {path}\npanel messages: {panels}\n"
              f"server log:\n{jupyterlab.log_tail()}")
        raise


def walk_through(jupyterlab, page, artifacts):
    """The user's steps; a screenshot after each."""
    t0 = time.monotonic()
    shots = []

    def shot(name, locator):
        path = artifacts / f"{len(shots) + 1:02d}-{name}.png"
        locator.scroll_into_view_if_needed()
        locator.screenshot(path=str(path))
        shots.append(path)

    page.set_default_timeout(30_000)
    page.goto(f"{jupyterlab.url}/lab/workspaces/w{uuid.uuid4().hex[:8]}/tree/{NOTEBOOK}"
              f"?reset&token={jupyterlab.token}")
    page.wait_for_function(KERNEL_IDLE, timeout=60_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    launcher = page.locator(".nbdist-launcher")
    bench = page.locator(".nbdist-bench")
    memory = page.locator(".nbdist-memory").first
    for panel in (launcher, bench, memory):
        panel.wait_for(state="attached", timeout=60_000)
    page.wait_for_function(KERNEL_IDLE, timeout=60_000)
    assert "no group is running" in launcher.locator(".nbdist-status-table").text_content()
    shot("launcher", launcher)

    # Start: wait until the table shows both ranks idle.
    launcher.locator("button.nbdist-start").click()
    page.wait_for_function(RANKS, arg=[2, "idle", "gloo"], timeout=60_000)
    no_errors(page)
    expect(launcher.locator(".nbdist-feedback")).to_contain_text("started 2 ranks (backend gloo")
    shot("started", launcher)

    # Work started from code shows in the table while it runs (the panel's thread refreshes it).
    page.evaluate("""() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel
        .requestExecute({code: "import time\\nnbdist.current_group().run(time.sleep, 3)"})""")
    page.wait_for_function(RANKS, arg=[2, "busy", "gloo"], timeout=10_000)
    expect(launcher.locator(".nbdist-col-state").first).to_contain_text("busy: run sleep")
    shot("busy", launcher)
    page.wait_for_function(RANKS, arg=[2, "idle", "gloo"], timeout=30_000)

    # The benchmark panel: Run, then the figure and the table appear below.
    bench.locator("button.nbdist-run").click()
    page.wait_for_function(FIGURE, arg=".nbdist-bench img.nbdist-figure", timeout=60_000)
    expect(bench.locator(".nbdist-records")).to_contain_text("all_reduce")
    no_errors(page)
    shot("bench", bench)

    # The memory panel: Run, then per-rank bars; the slider redraws the estimate for N ranks.
    memory.locator("button.nbdist-run").click()
    page.wait_for_function(FIGURE, arg=".nbdist-memory img.nbdist-bars", timeout=60_000)
    expect(memory.locator(".nbdist-report")).to_contain_text("zero1")
    expect(memory.locator(".nbdist-estimate")).to_contain_text("N=2)")
    memory.locator(".nbdist-world-size .noUi-handle").focus()
    page.keyboard.press("ArrowRight")
    # The notebook pressed Run on both panels itself, so their figures were there before these
    # clicks: the slider's redraw waits in the kernel behind the two runs the clicks started.
    expect(memory.locator(".nbdist-estimate")).to_contain_text("N=4)", timeout=60_000)
    no_errors(page)
    shot("memory", memory)

    # An unavailable backend is refused with its reason; the custom one is taken; Restart.
    select = launcher.locator(".nbdist-backend select")
    labels = [t.replace("\xa0", " ") for t in select.locator("option").all_text_contents()]
    assert "nbstore (custom)" in labels and "nccl ✗ unavailable" in labels
    select.select_option(index=labels.index("nccl ✗ unavailable"))
    expect(launcher.locator(".nbdist-error")).to_contain_text("NCCL is not built into this torch")
    shot("refused", launcher)
    select.select_option(index=labels.index("nbstore (custom)"))
    no_errors(page)
    launcher.locator("button.nbdist-restart").click()
    page.wait_for_function(RANKS, arg=[2, "idle", "nbstore"], timeout=60_000)
    expect(launcher.locator(".nbdist-feedback")).to_contain_text(
        "restarted 2 ranks (backend nbstore")
    shot("restarted", launcher)

    launcher.locator("button.nbdist-stop").click()
    page.wait_for_function("() => document.querySelector('.nbdist-launcher .nbdist-group')"
                           ".dataset.state === 'none'")
    no_errors(page)
    print(f"\nscreenshots ({time.monotonic() - t0:.0f} s):\n" + "\n".join(map(str, shots)))
