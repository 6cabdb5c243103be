"""Warm spares (issue 26): spawned workers that imported torch ahead of time become the ranks of the
next spawn start or restart (nbdist.runtime.spares). Real processes throughout."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import nbdist
from nbdist.runtime import launcher, spares

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def fresh_pool(monkeypatch):
    """No spare before the test, none after (spares are process-wide)."""
    monkeypatch.delenv(spares.ENV_VAR, raising=False)
    spares.close()
    yield
    spares.close()


def test_a_spawn_start_keeps_spares_that_the_restart_takes(fresh_pool, tmp_path, monkeypatch):
    with nbdist.start(2, start_method="spawn", timeout=60) as g:
        assert spares.settle(120)  # topped up in the background, not under the group's lock
        kept = spares.pids()
        assert len(kept) == 2 and set(kept).isdisjoint(g.run(os.getpid))
        for pid in kept:  # the caller's own children, waiting for a config
            assert psutil.Process(pid).ppid() == os.getpid()
        assert spares.ready(timeout=120) == 2  # torch imported, before they are needed
        # what the next start must see although the spares were spawned before it: the caller's
        # working directory, sys.path and environment as they are at the restart
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path / "extra"))
        monkeypatch.setenv("NBDIST_TEST_LATE", "yes")
        g.restart()
        assert sorted(g.run(os.getpid)) == sorted(kept)
        assert g.run(os.getcwd) == [str(tmp_path)] * 2
        assert g.run(lambda: sys.path[0]) == [str(tmp_path / "extra")] * 2
        assert g.run(lambda: os.environ.get("NBDIST_TEST_LATE")) == ["yes"] * 2
        assert g.run(lambda: (os.environ["RANK"], os.environ["WORLD_SIZE"])) == \
            [("0", "2"), ("1", "2")]
        g.exec("import torch, torch.distributed as dist\n"
               "x = torch.ones(3) * (dist.get_rank() + 1)\ndist.all_reduce(x)")
        assert [t.tolist() for t in g.exec("x")] == [[3.0] * 3] * 2
        assert spares.settle(120)
        assert len(spares.pids()) == 2 and set(spares.pids()).isdisjoint(kept)


def test_ready_waits_for_a_top_up_that_has_not_begun_yet(fresh_pool, monkeypatch):
    """Was: ready() counted the spares kept at the moment it was called, so right after a start
    took them (its top-up not begun, or its spawns in flight) it returned 0 at once, and the
    Wine benchmark's restart found no warm spare."""
    top_up = spares.top_up

    def late():  # a start's background top-up whose thread is slow to begin
        time.sleep(1.0)
        top_up()

    monkeypatch.setattr(spares, "top_up", late)
    thread = spares.warm()
    try:
        assert spares.ready(timeout=120) == spares.target() == len(spares.pids())
    finally:
        thread.join(120)


def test_a_dead_spare_is_passed_over_and_sigint_does_not_end_one(fresh_pool):
    spares.top_up()
    assert spares.ready(timeout=120) == 2
    first, second = spares.pids()
    os.kill(first, signal.SIGKILL)
    psutil.Process(first).wait(10)
    os.kill(second, signal.SIGINT)  # a kernel interrupt reaches the kernel's process group
    with nbdist.start(2, start_method="spawn", timeout=60) as g:
        pids = g.run(os.getpid)
        assert second in pids and first not in pids  # the other rank was spawned fresh
        assert g.run(lambda: 1 + 1) == [2, 2]


def test_larger_starts_take_what_is_kept_and_spawn_the_rest(fresh_pool, monkeypatch):
    monkeypatch.setenv(spares.ENV_VAR, "1")
    spares.top_up()
    (kept,) = spares.pids()
    with nbdist.start(3, start_method="spawn", timeout=60) as g:
        assert kept in g.run(os.getpid)
        assert spares.settle(120)
        assert len(spares.pids()) == 1  # NBDIST_SPARES, not the world size


def test_zero_spares_keeps_none_and_a_bad_value_is_refused_before_anything_starts(
        fresh_pool, monkeypatch):
    monkeypatch.setenv(spares.ENV_VAR, "0")
    with nbdist.start(2, start_method="spawn", timeout=60) as g:
        assert g.run(lambda: 1) == [1, 1]
    assert spares.pids() == []
    monkeypatch.setenv(spares.ENV_VAR, "lots")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="NBDIST_SPARES must be a whole number of spare workers "
                                         r"to keep warm \(0 turns them off\), got 'lots'"):
        nbdist.start(2, start_method="spawn", timeout=60)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_prewarm_spawns_the_spares_where_workers_are_spawned(fresh_pool, monkeypatch):
    monkeypatch.setenv("NBDIST_START_METHOD", "spawn")
    thread = launcher.prewarm()  # what %load_ext nbdist does
    assert thread is not None and thread.name == "nbdist-prewarm"
    thread.join(60)
    assert len(spares.pids()) == spares.target()
    spares.close()
    assert spares.pids() == []


def test_spares_end_with_the_process_that_kept_them(tmp_path):
    """A clean exit ends them (atexit), and so does a killed parent (their pipe closes)."""
    code = textwrap.dedent("""
        import os, signal, sys
        from nbdist.runtime import spares
        spares.top_up()
        print(*spares.pids(), flush=True)
        if sys.argv[1] == "kill":
            spares.ready(timeout=120)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    for how in ("exit", "kill"):
        out = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True,
                             timeout=150, env=dict(os.environ, NBDIST_SPARES="2"))
        pids = [int(p) for p in out.stdout.split()]
        assert len(pids) == 2, out.stderr
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                proc.wait(60)
            except psutil.NoSuchProcess:
                pass
            except psutil.TimeoutExpired:
                proc.kill()
                pytest.fail(f"spare {pid} outlived its parent ({how})")


# ---- issue 34, risk 5: spares never hold the kernel's exit --------------------------------------
LIVENESS = 60.0


class _Held:
    """Holds the first spare spawned right after its process started, before the pool keeps it
    (where a top-up on the prewarm thread is when close() comes)."""

    def __init__(self, monkeypatch):
        self.started, self.go = threading.Event(), threading.Event()
        real, held = spares.Spare, self

        class Held(real):
            def __init__(self, process, conn):
                super().__init__(process, conn)
                if not held.started.is_set():
                    held.pid = process.pid
                    held.started.set()
                    held.go.wait(LIVENESS)

        monkeypatch.setattr(spares, "Spare", Held)


def test_a_close_while_a_top_up_spawns_keeps_no_spare(fresh_pool, monkeypatch):
    """Was: close() set ``closing`` and reset it at once; a top-up still spawning on the prewarm
    thread then kept its spare and spawned more -- non-daemon children nobody closes."""
    held = _Held(monkeypatch)
    monkeypatch.setenv(spares.ENV_VAR, "2")
    epoch = getattr(spares._Pool, "epoch", 0)
    filler = spares.warm()  # the prewarm thread
    assert held.started.wait(LIVENESS)
    closer = threading.Thread(target=spares.close)
    closer.start()
    # close() has come: it returned (as it did), or it waits for the spawn in flight
    while closer.is_alive() and getattr(spares._Pool, "epoch", 0) == epoch:
        closer.join(0.01)
    held.go.set()
    closer.join(LIVENESS)
    filler.join(LIVENESS)
    assert not closer.is_alive() and not filler.is_alive()
    assert spares.pids() == []
    assert not psutil.pid_exists(held.pid)  # the spare in flight was reaped, not kept


EXIT_WHILE_FILLING = textwrap.dedent("""
    import atexit, threading
    from nbdist.runtime import spares
    started, go = threading.Event(), threading.Event()
    class Held(spares.Spare):
        def __init__(self, process, conn):
            super().__init__(process, conn)
            if not started.is_set():
                started.set()
                go.wait(60)
    spares.Spare = Held
    spares.warm()  # %load_ext nbdist
    started.wait(60)
    atexit.register(go.set)  # the top-up goes on while the interpreter exits
    print("exiting", flush=True)
""")


def test_the_interpreter_exits_while_a_top_up_spawns(tmp_path):
    """Was: the exit hung for good -- the top-up went on after the exit's close(), and
    multiprocessing's exit handler waited for its non-daemon spares."""
    p = subprocess.Popen([sys.executable, "-c", EXIT_WHILE_FILLING], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=dict(os.environ, NBDIST_SPARES="2"))
    try:
        out, err = p.communicate(timeout=LIVENESS)
    except subprocess.TimeoutExpired:
        p.kill()  # its spares end as their pipe closes
        out, err = p.communicate()
        pytest.fail(f"the interpreter did not exit while spares were topped up: {out!r} {err!r}")
    assert p.returncode == 0 and out == "exiting\n", err
