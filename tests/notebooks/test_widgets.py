"""The panels driven from Python, without a browser: set values, press buttons, check the panel's
state and the group. Groups are real worker processes (gloo, CPU)."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from traitlets import TraitError

import nbdist
import nbdist.ui.magics  # noqa: F401 -- registers %dist_ui (also loaded by %load_ext nbdist)
from nbdist.backends import backend_report, register_backend, unregister_backend
from nbdist.ui.widgets import (BenchPanel, Launcher, MemoryPanel, MeshPanel, bench_panel,
                               launcher, memory_panel)

PNG = b"\x89PNG"


@pytest.fixture
def nbstore():
    """nbdist's pure-Python store backend, registered as the custom backend ``nbstore``."""
    register_backend("nbstore", "nbdist.store_backend:create", devices=["cpu"], replace=True)
    yield "nbstore"
    unregister_backend("nbstore")


def states(panel: Launcher):
    """Each rank's state in the launcher's status, read now: the panel's own thread refreshes every
    ``refresh_interval`` s, so its last refresh may have run during the last call (a rank busy)."""
    panel.refresh()
    return [r.state for r in panel.status.ranks]


# ---- the launcher -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_launcher_lists_backends_and_refuses_unavailable_ones(cpu_only_torch, panels, nbstore):
    ui = panels(launcher)
    dropdown = ui._controls["backend"]
    labels = dict((value, label) for label, value in dropdown.options)
    assert labels["gloo"] == "gloo" and labels["nbstore"] == "nbstore (custom)"
    assert labels["auto"] == "auto → gloo"
    for name, usable, reason in backend_report("cpu"):
        if not usable:  # shown disabled, with the reason in the note under the options
            assert labels[name].endswith("✗ unavailable")
            assert reason.replace("'", "&#x27;") in ui._notes.value
    assert "NCCL is not built into this torch" in ui._notes.value

    dropdown.value = "nccl"  # refused: the reason in the panel, the choice as before
    assert "backend 'nccl' cannot be used with device='cpu'" in ui.error
    assert "NCCL is not built into this torch" in ui.error
    assert ui.backend == "auto" and dropdown.value == "auto"
    assert "NCCL is not built" in ui._feedback.value and "nbdist-error" in ui._feedback.value
    dropdown.value = "nbstore"
    assert ui.backend == "nbstore" and ui.error == ""
    with pytest.raises(TraitError, match="NCCL is not built into this torch"):
        ui.backend = "nccl"

    unregister_backend("nbstore")  # the panel follows the registry on its next refresh
    ui.refresh()
    assert "nbstore" not in [value for _, value in dropdown.options]
    assert ui.backend == "auto"


@pytest.mark.timeout(60)
def test_launcher_validates_every_option(cpu_only_torch, panels):
    ui = panels(launcher)
    ui._controls["device"].value = "cuda"
    assert "device='cuda' is not usable here: no CUDA device is visible" in ui.error
    assert ui.device == "cpu"
    assert "cuda ✗ unavailable" in [label for label, _ in ui._controls["device"].options]
    ui._controls["timeout"].value = 0.0
    assert ui.error == "timeout must be a positive number of seconds, got 0.0"
    assert ui.timeout == 60.0
    with pytest.raises(TraitError, match="refresh_interval must be a positive number"):
        ui.refresh_interval = -1.0
    with pytest.raises(TraitError, match="'zero9' not found in the strategy registry"):
        ui.strategy = "zero9"
    with pytest.raises(TraitError, match="should not be less than 1"):
        ui.world_size = 0

    # No group: the table says so, only Start can be pressed; Restart and Stop explain.
    assert "no group is running" in ui._table.value and ui.status is None
    assert not ui.buttons["start"].disabled
    assert ui.buttons["restart"].disabled and ui.buttons["stop"].disabled
    ui.buttons["restart"].click()
    assert ui.error.startswith("restarting the group failed: GroupClosedError: no nbdist group "
                               "is running: start one with the launcher")
    ui.buttons["stop"].click()
    assert ui.error.startswith("stopping the group failed: GroupClosedError: no nbdist group")


@pytest.mark.timeout(120)
def test_launcher_start_restart_stop_share_the_group_with_magics(shell, panels, nbstore):
    ui = panels(shell.run_line_magic, "dist_ui", "")  # %dist_ui: the launcher
    assert isinstance(ui, Launcher)
    ui.world_size, ui.backend = 2, "gloo"
    ui.buttons["start"].click()
    assert ui.error == ""
    group = nbdist.current_group()
    assert isinstance(group, nbdist.Group) and group.state == "ready"
    assert ui.message.startswith("started 2 ranks (backend gloo, device cpu)")
    assert states(ui) == ["idle", "idle"]
    assert [r.pid for r in ui.status.ranks] == [r.pid for r in group.status().ranks]
    assert ui._table.value.count("data-state='idle'") == 2
    assert ui.buttons["start"].disabled and not ui.buttons["stop"].disabled

    # The magics and the code see the same group; the strategy is a variable on the ranks.
    with capture_output() as captured:
        shell.run_line_magic("dist", "print('strategy', strategy, rank)")
    assert "[rank 1] strategy ddp 1" in captured.stdout
    ui.strategy = "zero1"
    assert group.pull("strategy") == ["zero1", "zero1"]

    ui.buttons["start"].click()  # a second Start does not start a second group
    assert ui.error.startswith("starting the group failed: NbdistError: a group is already "
                               "running")
    assert nbdist.current_group() is group

    ui.world_size = 3
    ui._controls["backend"].value = "nbstore"
    ui.buttons["restart"].click()
    assert ui.error == ""
    assert nbdist.current_group() is group
    assert (group.world_size, group.backend) == (3, "nbstore")
    assert group.run(lambda: torch.distributed.get_backend()) == ["nbstore"] * 3
    assert group.pull("strategy") == ["zero1"] * 3
    assert states(ui) == ["idle"] * 3 and ui.status.backend == "nbstore"

    pids = [r.pid for r in group.status().ranks]
    ui.buttons["stop"].click()
    assert ui.error == "" and ui.message.startswith("stopped the group")
    assert group.state == "stopped" and nbdist.current_group() is None
    assert ui.status is None and "no group is running" in ui._table.value
    assert all(r.state in ("stopped", "dead") for r in group.status().ranks) and pids


@pytest.mark.timeout(60)
def test_launcher_shows_api_errors_in_the_panel(panels):
    ui = panels(launcher, world_size=10000, backend="gloo")
    ui.buttons["start"].click()
    assert ui.error.startswith("starting the group failed: ValueError: world_size=10000 is more "
                               "than this machine runs well")
    assert nbdist.current_group() is None and ui.status is None


@pytest.mark.timeout(60)
def test_launcher_table_follows_a_running_call(shared_group, panels):
    nbdist.use_group(shared_group)
    ui = panels(launcher, refresh_interval=0.05)
    assert (ui.world_size, ui.backend, ui.device) == (2, "gloo", "cpu")  # took the group's options
    seen = []
    ui.observe(lambda change: seen.append(tuple(r.state for r in change["new"].ranks)
                                          if change["new"] else None), "status")
    shared_group.run(time.sleep, 1.0)  # the panel's thread refreshes while the kernel waits
    assert ("busy", "busy") in seen
    deadline = time.monotonic() + 5
    polled = lambda: [r.state for r in ui.status.ranks]  # noqa: E731 -- as the thread last read
    while polled() != ["idle", "idle"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert polled() == ["idle", "idle"]  # the panel's thread saw the call end by itself
    thread = ui._thread
    ui.close()
    assert not thread.is_alive()
    assert not [t for t in threading.enumerate() if t.name == "nbdist-launcher-status"
                and t is thread]


@pytest.mark.timeout(60)
def test_launcher_status_thread_shows_a_failed_refresh_and_goes_on(shared_group, panels,
                                                                   monkeypatch):
    """Was: one error in a refresh (status() during a stop, issue 25) ended the thread for good."""
    nbdist.use_group(shared_group)
    ui = panels(launcher, refresh_interval=0.05)
    broken = threading.Event()
    broken.set()
    real = type(shared_group).status

    def status(group):
        if broken.is_set():
            raise AttributeError("'NoneType' object has no attribute 'exitcode'")
        return real(group)

    monkeypatch.setattr(type(shared_group), "status", status)
    deadline = time.monotonic() + 20
    while "nbdist-refresh-error" not in ui._table.value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "refreshing the status failed: AttributeError: &#x27;NoneType&#x27; object has no " \
           "attribute &#x27;exitcode&#x27;; trying again" in ui._table.value
    assert "nbdist-ranks" in ui._table.value  # the last table read stays shown
    broken.clear()
    while "nbdist-refresh-error" in ui._table.value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "nbdist-refresh-error" not in ui._table.value and ui._thread.is_alive()
    assert states(ui) == ["idle", "idle"]


@pytest.mark.timeout(90)
def test_launcher_shows_a_running_job_and_restart_interrupts_it(panels):
    group = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    nbdist.use_group(group)
    ui = panels(launcher, refresh_interval=0.05)
    job = group.submit_exec("import time, nbdist\nfor i in range(600):\n"
                            "    nbdist.log(step=i, loss=1.0)\n    time.sleep(0.05)", name="train")
    deadline = time.monotonic() + 20
    while "nbdist-job" not in ui._table.value and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "job &#x27;train&#x27;: running" in ui._table.value
    ui.buttons["restart"].click()  # calls are refused while a job runs; Restart interrupts it
    assert job.done() and job.state in ("interrupted", "failed")
    assert group.state == "ready" and group.run(lambda: 1) == [1, 1]
    ui.refresh()
    assert "nbdist-job" not in ui._table.value


# ---- the benchmark panel ----------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_bench_panel_runs_and_compares(group, panels):
    bp = panels(bench_panel, group, ops=["all_reduce", "barrier"], sizes=("4K", "16K"),
                iters=2)
    assert bp._controls["sizes"].value == (4096, 16384)
    bp.run_button.click()
    assert bp.error == ""
    assert bp.progress.value == bp.progress.max == 4  # 3 sizes of all_reduce, 1 barrier
    assert [(r["op"], r["bytes"]) for r in bp.records] == [
        ("all_reduce", 4096), ("all_reduce", 8192), ("all_reduce", 16384), ("barrier", 0)]
    assert {r["status"] for r in bp.records} == {"ok"}
    assert "all_reduce" in bp._table.value and bytes(bp._figure.value).startswith(PNG)
    first = bytes(bp._figure.value)

    bp._controls["compare_world_size"].value = 3
    bp.compare_button.click()
    assert bp.error == ""
    assert len(bp.records) == 8
    assert [r["world_size"] for r in bp.records] == [2] * 4 + [3] * 4
    assert (group.world_size, group.state) == (2, "ready")  # put back
    assert "back to gloo, 2 ranks" in bp.message
    assert bytes(bp._figure.value).startswith(PNG) and bytes(bp._figure.value) != first


@pytest.mark.timeout(60)
def test_bench_panel_errors(panels):
    bp = panels(bench_panel)  # no group given: the current group when Run is pressed
    bp.run_button.click()
    assert bp.error.startswith("running the benchmark failed: GroupClosedError: no nbdist group "
                               "is running")
    with pytest.raises(TraitError, match="sizes must be two powers of two from 1 B to 1 GiB"):
        bp.sizes = ("3K", "1M")
    with pytest.raises(TraitError, match="cannot read the size"):
        bp.sizes = ("4Q", "1M")
    bp._controls["ops"].value = ()
    assert bp.error.startswith("unknown op (none given)") and bp.ops == ["all_reduce"]
    with pytest.raises(TraitError, match="backend 'nccl' cannot be used"):
        bp.compare_backend = "nccl"
    assert isinstance(bp, BenchPanel)


# ---- the memory panel -------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_memory_panel_measures_and_estimates(shared_group, panels):
    mp = panels(memory_panel, shared_group, model="mlp:2x64", strategies=["ddp", "zero1"])
    assert mp.num_params == 2 * (64 * 64 + 64)
    assert "Ψ=8,320, N=2" in mp._estimate_table.value
    mp.run_button.click()
    assert mp.error == ""
    assert [(r.strategy, r.rank) for r in mp.report] == [("ddp", 0), ("ddp", 1), ("zero1", 0),
                                                          ("zero1", 1)]
    assert mp.progress.value == mp.progress.max == 2
    assert bytes(mp._bars.value).startswith(PNG) and "zero1" in mp._report_table.value
    before = bytes(mp._estimate_figure.value)

    t0 = time.perf_counter()
    mp._controls["world_size"].value = 64  # the slider: the estimate is redrawn at once
    assert time.perf_counter() - t0 < 5
    assert "Ψ=8,320, N=64" in mp._estimate_table.value
    assert bytes(mp._estimate_figure.value) != before
    mp.world_size = 3  # not a slider stop: added to it
    assert 3 in mp._controls["world_size"].options and "N=3" in mp._estimate_table.value


@pytest.mark.timeout(180)
def test_memory_panel_measures_deepspeed(shared_group, panels):
    pytest.importorskip("deepspeed")
    mp = panels(memory_panel, shared_group, model="mlp:2x64")
    assert "deepspeed_zero3" in [value for _, value in mp._controls["strategies"].options]
    mp._controls["strategies"].value = ("deepspeed_zero3",)  # as a click in the list would
    mp.run_button.click()
    assert mp.error == "" and mp.progress.value == mp.progress.max == 1
    psi = 2 * (64 * 64 + 64)
    for r in mp.report:  # each rank holds half of the fp32 parameters and gradients
        assert (r.strategy, r.params, r.grads) == ("deepspeed_zero3", 2 * psi, 2 * psi)
    assert [r.rank for r in mp.report] == [0, 1]
    assert bytes(mp._bars.value).startswith(PNG) and "deepspeed_zero3" in mp._report_table.value
    assert "DeepSpeed keeps an fp32 master copy" in mp._report_table.value
    assert "deepspeed_zero3" in mp._estimate_table.value  # and the slider's estimate


@pytest.mark.timeout(60)
def test_memory_panel_inputs(panels):
    def make_model():
        return torch.nn.Linear(10, 5)

    mp = panels(memory_panel, model_fn=make_model)
    assert isinstance(mp, MemoryPanel) and mp.num_params == 55
    assert mp._controls["model"].disabled and mp._controls["model"].value == "model_fn: make_model"

    mp = panels(memory_panel, model="7.5B")
    assert mp.num_params == 7_500_000_000
    mp.run_button.click()
    assert "the model '7.5B' is a parameter count: it can be estimated" in mp.error
    mp._controls["model"].value = "foo"
    assert "got 'foo'" in mp.error and mp.model == "7.5B"
    mp._controls["strategies"].value = ()
    assert mp.error == "choose at least one strategy, e.g. ddp and fsdp"
    with pytest.raises(TraitError, match="precision must be one of"):
        mp.precision = "fp8"
    with pytest.raises(TraitError, match="not found in the strategy registry"):
        mp.strategies = ["ddp", "nope"]
    mp.model = "mlp:1x8"
    assert mp.num_params == 72 and "Ψ=72," in mp._estimate_table.value
    mp.run_button.click()
    assert mp.error.startswith("measuring failed: GroupClosedError: no nbdist group is running")


def test_panels_show_what_they_hold_on_a_page_without_widgets(panels):
    """Issue 35's review of tutorials 05 and 07: a page that cannot run the widgets showed the
    launcher, the benchmark and the memory panels as 'Launcher(children=(HTML(value=...' or an
    empty Out[]; each bundle carries the panel's text, tables and figures as they are now."""
    mp = panels(memory_panel, model="7.5B")
    data = mp._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"] == "nbdist memory per rank"
    page = data["text/html"]
    assert "Ψ=7,500,000,000," in page and page.count("<img src='data:image/png;base64,") == 1
    assert "need a running kernel" in page
    mp.run_button.click()  # no group: the error is what the panel shows, and what the text says
    assert panels(memory_panel, model="7.5B")._repr_mimebundle_()["text/plain"] == \
        "nbdist memory per rank"
    assert mp._repr_mimebundle_()["text/plain"].startswith(
        "nbdist memory per rank: measuring failed: ValueError: the model '7.5B' is a "
        "parameter count")
    text = panels(bench_panel)._repr_mimebundle_()["text/plain"]
    assert text == "nbdist collective benchmark", text
    assert panels(launcher)._repr_mimebundle_()["text/plain"].startswith("nbdist launcher")


# ---- %dist_ui -----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_dist_ui_magic(shell, panels):
    assert isinstance(panels(shell.run_line_magic, "dist_ui", "bench"), BenchPanel)
    assert isinstance(panels(shell.run_line_magic, "dist_ui", "memory"), MemoryPanel)
    assert isinstance(panels(shell.run_line_magic, "dist_ui", "mesh"), MeshPanel)
    with pytest.raises(UsageError, match=r"invalid choice: 'nope'[\s\S]*usage: %dist_ui"):
        shell.run_line_magic("dist_ui", "nope")
    with capture_output():
        result = shell.run_cell("ui = %dist_ui\nui")  # the panel is the cell's value
    assert result.success
    ui = panels(lambda: shell.user_ns.pop("ui"))
    assert isinstance(ui, Launcher) and result.result is ui
    data, _ = shell.display_formatter.format(ui)
    assert "application/vnd.jupyter.widget-view+json" in data
    with capture_output() as captured:
        shell.run_cell("%dist_ui?")
    assert "Show a panel: the launcher" in captured.stdout and "device mesh" in captured.stdout
