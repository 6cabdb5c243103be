"""Warm spares (issue 26): spawned workers that imported torch ahead of time become the ranks of the
next spawn start or restart (nbdist.runtime.spares). Real processes throughout."""
import os
import signal
import subprocess
import sys
import textwrap

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
        assert len(spares.pids()) == 2 and set(spares.pids()).isdisjoint(kept)


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
