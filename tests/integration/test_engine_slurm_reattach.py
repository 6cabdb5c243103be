"""Reserve once, iterate many (issue 36): a SLURM group started with ``keep_alive`` outlives a
SIGKILLed kernel, and ``nbdist.reattach()`` in another process takes its ranks back with their
variables and their process group -- ``dist.new_group`` works after it, rank 0 serving the store.
After ``keep_alive`` with no kernel the ranks exit and the job ends; reattaching to it then says so.
Against the real local SLURM of :mod:`slurm_helpers` (skipped, saying why, where it cannot start).
A subprocess plays the first kernel; this test process plays the next one."""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from slurm_helpers import LocalSlurm

import nbdist
from nbdist.errors import NbdistError

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def home():
    path = Path(tempfile.mkdtemp(prefix="nbdist-slurm-reattach-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(home):
    c = LocalSlurm(home / "cluster")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def runtime(home, monkeypatch, request):
    """Jupyter's runtime directory, of this test alone (the handle files go there)."""
    path = Path(tempfile.mkdtemp(prefix=request.node.name[:30] + "-", dir=home))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(path))
    return path


#: the first kernel: a keep_alive group, variables and a subgroup on its ranks, then SIGKILLed
KERNEL = textwrap.dedent("""
    import os, sys
    import nbdist
    g = nbdist.start(2, on="slurm", nodes=2, keep_alive=sys.argv[1], timeout=30, progress=False,
                     workdir=sys.argv[2], protect=sys.argv[3] == "protect")
    g.exec("x = rank * 10 + 7\\nsub = dist.new_group([0, 1])")
    print("JOB", g._launcher.job_id, flush=True)
    os.kill(os.getpid(), 9)
""")


def first_kernel(keep_alive, workdir, protect="plain"):
    """Run the first kernel to its SIGKILL; its job id."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", KERNEL, keep_alive, str(workdir), protect],
                          env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == -9, f"the first kernel: {done.returncode}\n{done.stderr[-3000:]}"
    job = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("JOB ")]
    assert job, done.stdout + done.stderr[-2000:]
    return job[0]


@pytest.mark.parametrize("protect", ["plain", "protect"])  # signed: the streams are pumped
def test_reattach_after_a_sigkilled_kernel_finds_the_variables_and_new_groups_work(
        cluster, runtime, home, protect):
    job = first_kernel("120", home / "jobs", protect)
    handle_file = runtime / f"nbdist-slurm-{job}.json"
    assert stat.S_IMODE(handle_file.stat().st_mode) == 0o600  # it holds the group key
    handle = json.loads(handle_file.read_text())
    assert (handle["engine"], handle["job"], handle["world_size"], handle["keep_alive"]) == \
        ("slurm", job, 2, 120.0)
    assert cluster.state(job) == "RUNNING"  # the kernel died; the job did not
    g = nbdist.reattach(progress=False)
    try:
        assert g.exec("x") == [7, 17]  # the variables of the first kernel's ranks
        assert g.exec("t = torch.ones(1) * (rank + 1); dist.all_reduce(t, group=sub); "
                      "t.item()") == [3.0, 3.0]
        # a new group needs the rendezvous store: rank 0 serves it, the dead kernel did not
        assert g.exec("pg = dist.new_group([0, 1]); t = torch.ones(1); "
                      "dist.all_reduce(t, group=pg); t.item()") == [2.0, 2.0]
        assert g.status().ranks[1].node == "1"
        g.exec("print('back on', rank)")  # their output reaches the new kernel
        assert g.last_output == {0: ["back on 0"], 1: ["back on 1"]}
    finally:
        g.stop()
    cluster.wait_empty(15.0)
    assert not handle_file.exists()  # stopped: nothing to reattach to


def test_keep_alive_passes_and_the_job_ends_then_reattach_says_it_ended(cluster, runtime, home):
    job = first_kernel("4s", home / "jobs")
    handle_file = runtime / f"nbdist-slurm-{job}.json"
    assert handle_file.exists()
    cluster.wait_empty(4 + 15.0)  # keep_alive with no kernel: the ranks exit, the job ends
    with pytest.raises(NbdistError, match=rf"reattach\(\): the saved group's job has ended "
                                          rf"\((SLURM job {job} is \w+|SLURM no longer knows "
                                          rf"job {job})\); its ranks and their variables are "
                                          rf"gone \(handle .* removed\). Start a new group"):
        nbdist.reattach(progress=False)
    assert not handle_file.exists()



def test_a_time_over_the_partitions_limit_is_refused_with_slurms_message(cluster, home):
    with pytest.raises(NbdistError, match=r"SLURM refused the job: sbatch: error: Batch job "
                                          r"submission failed: Requested time limit is invalid "
                                          r"\(missing or exceeds some limit\)"):
        nbdist.start(2, on="slurm", nodes=2, time="3:00:00", keep_alive="30m", progress=False,
                     workdir=str(home / "jobs"))
    assert cluster.jobs() == []


def test_ctrl_c_while_a_filler_job_holds_the_nodes_cancels_the_waiting_job(cluster, home,
                                                                           capsys):
    filler = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2",
                             "--output=/dev/null", "--wrap", "sleep 600"], capture_output=True,
                            text=True, timeout=30)
    assert filler.returncode == 0, filler.stderr
    filler = filler.stdout.strip().split(";")[0]
    try:
        def interrupt_once_pending():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                mine = set(cluster.jobs()) - {filler}
                if mine and cluster.state(mine.pop(), "%T %r") == "PENDING Resources":
                    time.sleep(2.5)  # the wait shows it (read once a second)
                    break
                time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)

        timer = threading.Thread(target=interrupt_once_pending)
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            nbdist.start(2, on="slurm", nodes=2, timeout=30, workdir=str(home / "jobs"))
        timer.join()
        err = capsys.readouterr().err
        assert "PENDING (Resources), waited " in err, err
        assert "(Ctrl-C while its ranks were joining)" in err
        assert cluster.jobs() == [filler]  # ours went; the filler still holds the nodes
    finally:
        subprocess.run(["scancel", filler], capture_output=True, timeout=30)
    cluster.wait_empty(30.0)
    for node in ("n1", "n2"):  # cancelling the filler left the nodes usable
        cluster.wait_idle(node)
