"""``keep_alive`` and ``nbdist.reattach()`` without a cluster: the engine ``here``
(:mod:`here_engine`) places its ranks on this machine as ``python -m nbdist.worker --connect``
processes, as srun does on SLURM's nodes, and the rest is the runtime's, shared by every engine.
A subprocess plays the first kernel, SIGKILLed -- here while a call runs on the ranks --; this test
process plays the next one. What a lost call means: it runs to its end on the ranks, its result is
lost, its output goes to the ranks' log, the variables it set stay, and the next kernel says so."""
import importlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from here_engine import HERE, alive, end, register, wait_gone

import nbdist
from nbdist.errors import DistTimeoutError, NbdistError

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]

#: the first kernel: a keep_alive group with a variable on its ranks; SIGKILLed between calls, or
#: while a call (which waits for the file ``go``) runs on the ranks
KERNEL = textwrap.dedent("""
    import os, sys, threading, time
    import nbdist
    keep_alive, workdir, when = sys.argv[1:4]
    g = nbdist.start(2, on="here", keep_alive=keep_alive, timeout=30, progress=False,
                     workdir=workdir)
    g.exec("x = rank * 10 + 7")
    if when == "during_call":
        call = ("import os, time\\n"
                f"open(os.path.join({workdir!r}, f'started-{{rank}}'), 'w').close()\\n"
                f"while not os.path.exists(os.path.join({workdir!r}, 'go')): time.sleep(0.05)\\n"
                "y = rank + 100\\nprint('finished the call on rank', rank)\\ny")
        threading.Thread(target=g.exec, args=(call,), daemon=True).start()
        while not all(os.path.exists(os.path.join(workdir, f"started-{r}")) for r in (0, 1)):
            time.sleep(0.05)
    print("READY", flush=True)
    os.kill(os.getpid(), 9)
""")


@pytest.fixture
def here(tmp_path, monkeypatch):
    """The engine ``here`` registered (for this process and the first kernel), Jupyter's runtime
    directory of this test alone; the ranks' pids, killed at the end whatever happened."""
    registry = register(tmp_path / "site")
    monkeypatch.syspath_prepend(str(registry))
    importlib.invalidate_caches()
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    pids = []
    yield pids
    end(pids)


def first_kernel(tmp_path, pids, keep_alive, when):
    """Run the first kernel to its SIGKILL; its handle's path and content (its ranks' pids are
    added to ``pids``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE),
                                                        str(tmp_path / "site")]))
    done = subprocess.run([sys.executable, "-c", KERNEL, keep_alive, str(tmp_path / "job"), when],
                          env=env, capture_output=True, text=True, timeout=180)
    handles = list((tmp_path / "runtime").glob("nbdist-here-*.json"))
    for path in handles:
        pids.extend(json.loads(path.read_text())["pids"])
    assert done.returncode == -9 and "READY" in done.stdout, \
        f"the first kernel: {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert len(handles) == 1, handles
    return handles[0], json.loads(handles[0].read_text())


def test_a_kernel_killed_during_a_call_the_ranks_finish_it_and_reattach_says_its_result_is_lost(
        tmp_path, here, capsys):
    handle_file, handle = first_kernel(tmp_path, here, "120", "during_call")
    assert handle["engine"] == "here" and len(alive(handle["pids"])) == 2  # the kernel died
    host, port = handle["address"]
    # another program takes the address the ranks look for their controller at (they are busy
    # with the call: none connects to it)
    with socket.create_server((host, port)):
        with pytest.raises(NbdistError, match=rf"reattach: cannot listen on {host}:{port}, where "
                                              r"the ranks look for their controller \(.*\)\. Is "
                                              r"another kernel attached to them, or did another "
                                              r"program take the port\?"):
            nbdist.reattach(progress=False, join_timeout=30)
    # the ranks are still in the call: they come back only once it ends
    with pytest.raises(DistTimeoutError, match=r"reattach: ranks 0, 1 did not come back within "
                                               r"2 s; 0 of 2 connected\. A rank still running "
                                               r"the call it had when its kernel died comes back "
                                               r"once that call ends: reattach\(\) again \(the "
                                               r"ranks wait on\), or with a longer join_timeout\."):
        nbdist.reattach(progress=False, join_timeout=2)
    assert handle_file.exists() and len(alive(handle["pids"])) == 2  # nothing lost by trying
    (tmp_path / "job" / "go").touch()  # the call running since before the kernel died ends
    g = nbdist.reattach(progress=False, join_timeout=60)
    try:
        err = capsys.readouterr().err
        assert "nbdist: ranks 0, 1 were running a call when the kernel that sent it went; it ran " \
               "to its end with no kernel to answer, so its result (its value or its error) is " \
               "lost and its output went to the job's log. The variables it set are on the " \
               "ranks." in err, err
        assert g.exec("x") == [7, 17]  # the first kernel's variables
        assert g.exec("y") == [100, 101]  # ... and those of the call it lost
        assert g.exec("pg = dist.new_group([0, 1]); t = torch.ones(1) * (rank + 1); "
                      "dist.all_reduce(t, group=pg); t.item()") == [3.0, 3.0]
        for rank in (0, 1):
            log = (tmp_path / "job" / f"rank-{rank}.log").read_text()
            assert f"finished the call on rank {rank}" in log, log
            assert "lost the controller; keeping this rank" in log, log
        g.exec("print('back on', rank)")  # a new call's output reaches the new kernel
        assert g.last_output == {0: ["back on 0"], 1: ["back on 1"]}
    finally:
        g.stop()
    assert wait_gone(handle["pids"], 15.0) == []
    assert not handle_file.exists()  # stopped: nothing to reattach to


def test_keep_alive_passes_the_ranks_exit_and_reattach_says_the_job_ended(tmp_path, here):
    handle_file, handle = first_kernel(tmp_path, here, "3s", "between_calls")
    assert wait_gone(handle["pids"], 3 + 15.0) == []  # no kernel came back within keep_alive
    log = (tmp_path / "job" / "rank-0.log").read_text()
    assert "no controller reattached within keep_alive (3 s); exiting" in log, log
    with pytest.raises(NbdistError, match=rf"reattach\(\): the saved group's job has ended \(the "
                                          rf"ranks of {handle['job']} exited\); its ranks and "
                                          r"their variables are gone \(handle .* removed\)\. "
                                          r"Start a new group, e\.g\. nbdist\.start\(2, "
                                          r"on='here', keep_alive='30m'\)\."):
        nbdist.reattach(progress=False)
    assert not handle_file.exists()
