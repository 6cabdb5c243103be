"""nbdist.runtime.forkserver: the hidden ``__main__`` while workers (or the forkserver) start."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from nbdist.runtime.forkserver import main_hidden


def _run_in_thread(target):
    """Start ``target`` in a thread; the returned list gets the exception it raised, if any."""
    errors = []

    def run():
        try:
            target()
        except BaseException as err:  # noqa: BLE001 -- handed to the test, which re-raises it
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


@pytest.mark.timeout(30)
def test_overlapping_main_hidden_in_two_threads_restore_the_real_main():
    """Thread A hides ``__main__``, B hides it too, A leaves first, then B: B must still see a
    stand-in after A left, and the real ``__main__`` must be back once both have left."""
    real = sys.modules["__main__"]
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with main_hidden():
            seen["a"] = sys.modules["__main__"]
            a_in.set()
            assert b_in.wait(10)
        a_out.set()

    def b():
        assert a_in.wait(10)
        with main_hidden():
            b_in.set()
            assert a_out.wait(10)
            seen["b after a left"] = sys.modules["__main__"]

    threads = [_run_in_thread(a), _run_in_thread(b)]
    for thread, errors in threads:
        thread.join(20)
        assert not thread.is_alive()
        if errors:
            raise errors[0]
    assert sys.modules["__main__"] is real
    for when, main in seen.items():
        assert main is not real and not hasattr(main, "__file__"), when


@pytest.mark.timeout(30)
def test_main_hidden_nested_and_after_an_error():
    real = sys.modules["__main__"]
    with pytest.raises(RuntimeError, match="inside"):
        with main_hidden():
            with main_hidden():
                assert sys.modules["__main__"] is not real
            assert sys.modules["__main__"] is not real
            raise RuntimeError("inside")
    assert sys.modules["__main__"] is real


ROOT = pathlib.Path(__file__).resolve().parents[2]
SIGINT_BIT = 1 << (2 - 1)  # SIGINT is signal 2 in /proc/<pid>/status masks

PREWARM_THEN_FORK = """
import json, shutil, signal, sys
from multiprocessing import forkserver
from nbdist.runtime.forkserver import main_hidden, mp_context, prewarm

prewarm().join(60)
child = mp_context().Process(target=shutil.copyfile, args=("/proc/self/status", sys.argv[1]))
with main_hidden():
    child.start()  # answered once the forkserver has imported torch
child.join(60)
with open(f"/proc/{forkserver._forkserver._forkserver_pid}/status") as status:
    server = status.read()
print(json.dumps({"server": server, "exitcode": child.exitcode,
                  "blocked_here": signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []),
                  "handler_here": signal.getsignal(signal.SIGINT) is signal.default_int_handler}))
"""


def _masks(status: str) -> dict:
    return {k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines()
                                      if line.startswith(("SigBlk", "SigIgn")))}


NO_FORKSERVER = pytest.mark.skipif(
    sys.platform == "win32", reason="Windows has no forkserver (and no SIGINT mask): workers start "
    "by spawn there (docs/platforms.md)")


@NO_FORKSERVER
@pytest.mark.timeout(120)
def test_prewarmed_forkserver_ignores_sigint_and_its_children_do_not_inherit_a_block(tmp_path):
    """prewarm() starts the forkserver with SIGINT blocked (Ctrl-C during its start-up is held
    back); nbdist.runtime.preload ignores it and unblocks it, so workers can be interrupted."""
    child_status = tmp_path / "child-status"
    out = subprocess.run([sys.executable, "-c", PREWARM_THEN_FORK, str(child_status)],
                         capture_output=True, text=True, timeout=100,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["exitcode"] == 0
    assert not report["blocked_here"] and report["handler_here"]  # the caller is as it was
    server = _masks(report["server"])
    assert server["SigIgn"] & SIGINT_BIT and not server["SigBlk"] & SIGINT_BIT
    assert not _masks(child_status.read_text())["SigBlk"] & SIGINT_BIT


@pytest.mark.timeout(120)
def test_importing_the_preload_elsewhere_changes_no_signal_handling():
    code = ("import signal, nbdist.runtime.preload\n"
            "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "ok", out.stderr


CLOSE_HELPERS = """
import json, os, psutil, nbdist
from multiprocessing import forkserver, resource_tracker
from nbdist.runtime.forkserver import close_helpers

g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
g.stop()
helpers = [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
close_helpers()
left = [c.pid for c in psutil.Process().children(recursive=True)]  # zombies count here too
g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)  # the helpers start again
again = g.run(lambda: 1)
g.stop()
print(json.dumps({"helpers": helpers, "left": left, "again": again}))
"""


@NO_FORKSERVER
@pytest.mark.timeout(120)
def test_close_helpers_ends_and_reaps_the_forkserver_and_tracker_and_groups_start_again():
    """What the kernel's shutdown hook relies on: after close_helpers() this process has no child
    at all (none signalled and left a zombie), and a later group starts the helpers afresh."""
    out = subprocess.run([sys.executable, "-c", CLOSE_HELPERS], capture_output=True, text=True,
                         timeout=100, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(report["helpers"]) and report["left"] == [] and report["again"] == [1, 1]
