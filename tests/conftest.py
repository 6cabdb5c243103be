"""Suite-wide fixtures: every test is checked for leaked child processes and shm segments, and for
locks taken out of the order nbdist.wire.locks declares."""
import glob
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import time

import psutil
import pytest

from nbdist.wire import locks

locks.check(True)  # every lock nbdist makes from here on checks the order (nbdist.wire.locks)

# The tests' Ctrl-C is a real SIGINT, as a kernel gets it. A pytest started in the background by a
# shell without job control (`cmd &`, nohup, a CI step runner) inherits SIGINT *ignored*, and the
# interrupt tests then wait for an interrupt that never comes: give SIGINT Python's usual handler.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _helper_pids():
    """multiprocessing's own long-lived helpers (forkserver, resource tracker) and nbdist's warm
    spares (kept for the next spawn start, ended at exit): not leaks."""
    import multiprocessing.resource_tracker as mp_tracker

    from nbdist.runtime import spares

    server = getattr(mp_forkserver, "_forkserver", None)
    tracker = getattr(mp_tracker, "_resource_tracker", None)
    return {getattr(server, "_forkserver_pid", None), getattr(tracker, "_pid", None),
            *spares.pids()}


def _children():
    me = psutil.Process()
    try:
        procs = me.children(recursive=True)
    except psutil.Error:
        return {}
    keep = {}
    helpers = _helper_pids()
    for p in procs:
        if p.pid in helpers:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            keep[p.pid] = " ".join(p.cmdline())[:200]
        except psutil.Error:
            pass
    return keep


def _segments():
    """Segments of this process's groups that are no longer running (other sessions may share
    /dev/shm; a running group legitimately keeps its pooled result segments)."""
    from nbdist.runtime.group import _live, started_ids
    from nbdist.wire.segments import SHM_DIR  # /dev/shm, or the temp dir where there is none

    running = {g.id for g in list(_live) if g.state != "stopped"}
    return {p for p in glob.glob(os.path.join(SHM_DIR, "nbdist-*"))
            if os.path.basename(p).split("-")[1] in started_ids - running}


@pytest.fixture(autouse=True, scope="session")
def lightning_warmup_off():
    """nbdist's cell hook has every idle group's ranks import Lightning once the kernel has it (a
    notebook's first fit then waits less). The suite imports Lightning early, so in-process IPython
    cells of later tests would set their ranks importing it, ahead of what the test runs (CI: a
    job's stacks showed that import, not the job). Off for the suite; a test of the warm-up turns
    it on and back off itself."""
    from nbdist.lightning import warmup

    warmup.AUTO = False
    yield


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Fail a test that leaves child processes or nbdist shared-memory segments behind."""
    before = _children()
    segs_before = _segments()
    inversions = len(locks.violations())
    yield
    assert locks.violations()[inversions:] == [], "a lock was taken out of order (see above)"
    if request.node.get_closest_marker("allow_leaks"):
        return
    deadline = time.monotonic() + 5.0
    leaked = {}
    while time.monotonic() < deadline:
        leaked = {pid: cmd for pid, cmd in _children().items() if pid not in before}
        if not leaked:
            break
        time.sleep(0.1)
    for pid in leaked:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    new_segs = _segments() - segs_before
    for path in new_segs:
        os.unlink(path)
    assert not leaked, f"test leaked child processes: {leaked}"
    assert not new_segs, f"test leaked shared-memory segments: {sorted(new_segs)}"


#: The start methods the parametrised suites run under (issue 20): spawn is Windows' only one.
START_METHODS = ("forkserver", "spawn")


@pytest.fixture
def start_method():
    """How the ``group`` fixture starts its workers: ``None`` (the default). A test parametrised
    with ``@pytest.mark.parametrize("start_method", START_METHODS)`` overrides it."""
    return None


@pytest.fixture
def group(start_method):
    """A fresh 2-rank gloo group, stopped after the test."""
    import nbdist

    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30, start_method=start_method)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def shared_group(request):
    """A 2-rank group shared by a module's tests (they must leave it usable). A module that
    overrides it with ``params=START_METHODS`` gets one group per start method."""
    import nbdist

    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30,
                     start_method=getattr(request, "param", None))
    yield g
    g.stop()


@pytest.fixture
def cpu_only_torch(monkeypatch):
    """This process's torch answers as a CPU-only build on a machine without a GPU (the suite's
    own setting: CI installs the +cpu wheel). Tests of nbdist's refusals for CUDA, NCCL, MPI or
    UCC use it, so they also pass with a CUDA torch on a GPU host; the answers for such a host
    are faked in tests/unit/test_backends.py (``fake_cuda``)."""
    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for name in ("is_nccl_available", "is_mpi_available", "is_ucc_available",
                 "is_xccl_available"):
        monkeypatch.setattr(dist, name, lambda: False, raising=False)


#: The tutorials, run by tests/notebooks/test_tutorials.py and rendered by tests/docs/test_docs.py.
NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")


@pytest.fixture(scope="session")
def tutorial_runs(tmp_path_factory):
    """``run(name)``: the tutorial ``notebooks/<name>`` executed top to bottom in a fresh kernel
    (nbclient, widget state kept, its own working directory), once per session. The tutorial tests
    check its outputs and the docs build renders the same executed copy, so each tutorial runs
    once, not twice. A tutorial that failed raises its error again for every test that asks."""
    import copy

    import nbformat
    from nbclient import NotebookClient

    runs = {}

    def run(name):
        if name not in runs:
            nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
            cwd = tmp_path_factory.mktemp(name.split(".")[0])
            try:
                NotebookClient(nb, timeout=240, kernel_name="python3", store_widget_state=True,
                               resources={"metadata": {"path": str(cwd)}}).execute()
                runs[name] = nb
            except Exception as exc:  # kept, so the next test asking gets the same failure
                runs[name] = exc
        result = runs[name]
        if isinstance(result, Exception):
            raise RuntimeError(f"tutorial {name} failed when the session ran it") from result
        return copy.deepcopy(result)

    return run
