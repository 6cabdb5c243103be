"""Risks found while reading the runtime, each reproduced on real groups (issue 16)."""
import glob
import os
import tempfile
import threading
import time

import pytest

import nbdist


def _leftover_dirs(group_id):
    return glob.glob(os.path.join(tempfile.gettempdir(), f"nbdist-{group_id}-p*"))


@pytest.mark.timeout(120)
def test_a_failed_restart_leaves_a_broken_group_that_says_so(monkeypatch):
    """Was: a failure early in restart() (before the relay existed) left the group "ready" with no
    output relay, and the next call raised AttributeError instead of GroupClosedError."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    try:
        monkeypatch.setattr(tempfile, "tempdir", "/nonexistent-nbdist-test-dir")
        with pytest.raises(FileNotFoundError):
            g.restart()
        monkeypatch.undo()
        assert g.state == "broken"
        with pytest.raises(nbdist.GroupClosedError, match="broken after an earlier failure.*"
                                                          "call restart"):
            g.run(os.getpid)
        g.restart()
        assert len(set(g.run(os.getpid))) == 2
    finally:
        g.stop()


@pytest.mark.timeout(120)
def test_stop_from_another_thread_during_a_call_ends_the_call_cleanly():
    """Was: stop(timeout) from another thread killed *and closed* the process handles the running
    call still used (ValueError: process object is closed), and the group could stay busy with its
    temp dir and relay leaked."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    outcome = {}

    def long_call():
        try:
            outcome["value"] = g.run(time.sleep, 60)
        except BaseException as err:  # noqa: BLE001 -- the test inspects whatever it was
            outcome["error"] = err

    worker = threading.Thread(target=long_call)
    worker.start()
    deadline = time.monotonic() + 20
    while g.state != "busy" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert g.state == "busy"
    t0 = time.monotonic()
    g.stop(timeout=0.2)
    worker.join(30)
    assert not worker.is_alive()
    assert time.monotonic() - t0 < 20
    err = outcome.get("error")
    assert isinstance(err, nbdist.GroupClosedError), repr(err)
    assert "stopped (stop() from another thread) while 'run sleep' ran" in str(err)
    assert g.state == "stopped"
    assert all(row.state in ("dead", "stopped") for row in g.status().ranks)
    assert _leftover_dirs(g.id) == []
    with pytest.raises(nbdist.GroupClosedError, match="was stopped"):
        g.run(os.getpid)
    g.stop()  # idempotent


@pytest.mark.timeout(120)
def test_status_from_another_thread_while_ranks_die():
    """status() reads ranks without the lock: it must never touch a closed process handle."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30, auto_restart=True)
    errors = []
    done = threading.Event()

    def poll():
        while not done.is_set():
            try:
                str(g.status())
            except Exception as err:  # noqa: BLE001 -- collected and asserted below
                errors.append(err)

    t = threading.Thread(target=poll)
    t.start()
    try:
        for _ in range(3):
            with pytest.raises(nbdist.RankDiedError):
                g.exec("import os\nif rank == 1: os._exit(7)\nimport time; time.sleep(5)")
            assert g.run(os.getpid)  # auto_restart brings it back
    finally:
        done.set()
        t.join(10)
        g.stop()
    assert errors == []
