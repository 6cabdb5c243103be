"""Start methods and the code paths written for Windows, run on Linux (issue 20).

``start_method="spawn"`` is the only way to start workers on Windows; here it runs on Linux next to
the default forkserver. The Windows-only branches nbdist has (polled process exits instead of
sentinels in a selector, interrupts without ``pthread_kill``, a key file without ``fchmod``) are
switched on here by taking away what Linux has, with real processes; docs/platforms.md lists what
still differs on Windows and macOS.
"""
import os
import stat
import subprocess
import sys

import psutil
import pytest

import nbdist
from nbdist.runtime import attach, forkserver, processes
from nbdist.wire import segments

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_spawned_ranks_are_the_callers_children_and_keep_the_method_on_restart(start_method):
    with nbdist.start(2, start_method=start_method) as g:
        parents = g.run(os.getppid)
        assert g.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]
        g.restart()
        assert g.run(os.getppid) == parents
    if start_method == "spawn":  # spawn: the caller itself started each rank
        assert parents == [os.getpid()] * 2
    else:  # forkserver: the server (a child of the caller) forked them
        assert parents[0] == parents[1] != os.getpid()
        assert psutil.Process(parents[0]).ppid() == os.getpid()


def test_the_environment_variable_chooses_the_default(monkeypatch):
    from nbdist.runtime.forkserver import prewarm

    monkeypatch.setenv("NBDIST_START_METHOD", "spawn")
    assert prewarm() is None  # no forkserver to warm: %load_ext nbdist starts nothing
    with nbdist.start(2) as g:
        assert g.run(os.getppid) == [os.getpid()] * 2


@pytest.mark.timeout(30)
def test_an_unknown_start_method_is_refused_before_anything_starts(monkeypatch):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="start_method must be one of 'forkserver', 'spawn' on "
                                         "this platform, got 'fork'"):
        nbdist.start(2, start_method="fork")
    monkeypatch.setenv("NBDIST_START_METHOD", "threads")
    with pytest.raises(ValueError, match=r"got 'threads' \(from NBDIST_START_METHOD\)"):
        nbdist.start(2)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@pytest.mark.parametrize("how", ["during a call", "while starting"])
def test_a_dead_rank_is_found_when_exits_are_polled_as_on_windows(monkeypatch, how):
    """Windows' select() takes sockets only: there nbdist polls process exits. Same verdicts."""
    monkeypatch.setattr(processes, "SENTINELS_SELECTABLE", False)
    if how == "while starting":
        ns = {"__name__": "__main__"}
        exec("import os\ndef create(store, rank, size, timeout):\n"
             "    os.write(2, b'creator failed badly\\n'); os._exit(7)\n", ns)
        nbdist.register_backend("crasher_polled", ns["create"], devices=["cpu"], replace=True)
        try:
            with pytest.raises(nbdist.RankDiedError, match="exited with code 7"):
                nbdist.start(2, backend="crasher_polled", timeout=5, init_timeout=60,
                             start_method="spawn")
        finally:
            nbdist.backends.unregister_backend("crasher_polled")
        return
    with nbdist.start(2, start_method="spawn", timeout=30) as g:
        with pytest.raises(nbdist.RankDiedError, match="exited with code 3"):
            g.exec("import os, time\nif rank == 1: os._exit(3)\ntime.sleep(60)")
        g.restart()
        assert g.run(lambda: 5) == [5, 5]


@pytest.mark.parametrize("code", ["import time; time.sleep(30)",
                                  "n = 0\nwhile True: n += 1"], ids=["sleep", "python loop"])
def test_an_interrupt_without_pthread_kill_interrupts_the_ranks(code):
    """On Windows there is no ``signal.pthread_kill``: the interrupt button must still interrupt
    the ranks' code -- a sleep and a pure-Python loop -- and leave the ranks running."""
    import signal
    import threading

    with nbdist.start(2, start_method="spawn", grace=5.0) as g:
        g.exec("import signal; del signal.pthread_kill")
        pids = [r.pid for r in g.status().ranks]
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))  # the interrupt button
        timer.start()
        try:
            with pytest.raises(nbdist.GroupInterrupted) as info:
                g.exec(code)
        finally:
            timer.cancel()
        assert info.value.interrupted == [0, 1] and info.value.killed == [], str(info.value)
        assert [r.pid for r in g.status().ranks] == pids
        assert g.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]


def test_the_key_file_is_private_without_fchmod(monkeypatch, tmp_path):
    path = tmp_path / "key.hex"
    path.write_text("old")
    path.chmod(0o644)
    monkeypatch.delattr(os, "fchmod")  # as on Windows
    assert attach.write_key(b"\x01\x02", str(path)) == str(path)
    assert path.read_text() == "0102"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_orphan_probe_never_signals_a_process():
    """``_alive`` must not be ``os.kill(pid, 0)``: on Windows that call terminates the process."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert segments._alive(child.pid)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
    assert not segments._alive(child.pid)


def test_a_tmpdir_too_long_for_the_forkserver_s_socket_is_named_and_spawn_still_works(tmp_path):
    """Was: ``OSError: AF_UNIX path too long`` from deep inside multiprocessing."""
    long_dir = tmp_path / ("d" * 120)
    long_dir.mkdir()
    code = ("import nbdist\n"
            "try:\n    nbdist.start(2)\nexcept ValueError as err:\n    print('ERR', err)\n"
            "with nbdist.start(2, start_method='spawn') as g:\n    print('RAN', g.run(abs, -3))\n")
    env = dict(os.environ, TMPDIR=str(long_dir))
    env.pop("NBDIST_START_METHOD", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120).stdout
    assert "ERR the forkserver that starts nbdist's workers cannot listen under this TMPDIR: " \
           "its socket path would take " in out, out
    assert f"a Unix socket's path may take {forkserver.SUN_PATH}. Set TMPDIR to a shorter " \
           "directory" in out
    assert "start(..., start_method='spawn'), or NBDIST_START_METHOD=spawn" in out
    assert "RAN [3, 3]" in out
