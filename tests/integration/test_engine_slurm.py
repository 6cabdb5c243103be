"""``nbdist.start(on="slurm")`` against a real SLURM (issue 36): one slurmctld and two slurmd nodes
on this machine (:mod:`slurm_helpers`; the module skips saying why when it cannot start one).

One group (two ranks, one per node) serves the feature tests: the same worker as every group, so
``%%dist``, background jobs, stacks, the collective benchmark, ``memory.measure`` and a Lightning
fit work on it. Other tests submit their own job: SLURM's refusal, Ctrl-C while the job waits,
the kernel's exit and a SIGKILLed kernel -- each leaving ``squeue`` empty. The last tests fail a
node -- set down under the shared group, then a killed slurmd under a group of its own (SLURM
notices after SlurmdTimeout, ~30 s here) -- each a ``RankDiedError`` naming the rank, the node and
SLURM's reason."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
from engine_checks import lightning_fit_one_epoch, magic_cell_job_and_stacks
from slurm_helpers import LocalSlurm

import nbdist
from nbdist.errors import NbdistError

pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file


@pytest.fixture(scope="module")
def home():
    """The cluster's state and the jobs' files: not under pytest's temp dir, which a pytest run
    started meanwhile on this machine may prune (slurmd's spool going away fails its jobs)."""
    path = Path(tempfile.mkdtemp(prefix="nbdist-slurm-tests-"))
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
def tmp_path(home, request):
    """A fresh directory for the test's job files, under :func:`home`."""
    return Path(tempfile.mkdtemp(prefix=request.node.name[:40] + "-", dir=home))


@pytest.fixture(scope="module")
def g(cluster, home):
    """Two ranks in one SLURM job, one on each node; the queue empty after its stop."""
    group = nbdist.start(2, on="slurm", nodes=2, timeout=30, progress=False,
                         workdir=str(home / "jobs"))
    try:
        yield group
    finally:
        nbdist.use_group(None)
        group.stop()
        cluster.wait_empty(15.0)


def test_the_ranks_get_torchruns_variables_and_their_slurm_nodes(g):
    assert (g.backend, g.device) == ("gloo", "cpu")
    env = g.exec("import os\n[os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
                 "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'SLURMD_NODENAME')]")
    assert env == [["0", "0", "2", "1", "0", "n1"], ["1", "0", "2", "1", "1", "n2"]]
    assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
        [[3.0, 3.0]] * 2
    assert [r.node for r in g.status().ranks] == ["0", "1"]
    with pytest.raises(nbdist.RemoteError, match=r"ValueError on rank 1 \(node 1: n2, host "):
        g.exec("if rank == 1:\n    raise ValueError('boom')")
    with pytest.raises(nbdist.GroupClosedError, match="a SLURM group run in its job; nbdist does "
                                                      "not restart them"):
        g.restart()


def test_dist_magic_a_background_job_and_stacks(g):
    magic_cell_job_and_stacks(g, "on_slurm")


def test_collective_benchmark_and_memory_measure(g):
    from nbdist import memory

    out = nbdist.bench.collectives(g, ops="all_reduce", sizes="4K", iters=2, warmup=1,
                                   progress=False)
    assert [r["status"] for r in out] == ["ok"]
    rep = memory.measure(g, _small, ["ddp"], optimizer="sgd", steps=1, batch=8)
    assert {(r.strategy, r.rank) for r in rep} == {("ddp", 0), ("ddp", 1)}


def _small():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_lightning_fit(g, tmp_path):
    lightning_fit_one_epoch(g, tmp_path)


# ---- jobs of their own: refused, cancelled, a kernel that goes -----------------------------------
def test_options_slurm_refuses_come_back_as_its_message_with_nothing_queued(cluster, tmp_path):
    before = cluster.jobs()
    with pytest.raises(NbdistError, match=r"SLURM refused the job: sbatch: error: invalid "
                                          r"partition specified: nope"):
        nbdist.slurm.start(2, nodes=2, partition="nope", progress=False, workdir=str(tmp_path))
    with pytest.raises(NbdistError, match=r"SLURM refused the job: sbatch: error: Invalid "
                                          r"--time specification"):
        nbdist.slurm.start(2, nodes=2, time="forever", progress=False, workdir=str(tmp_path))
    assert cluster.jobs() == before  # nothing new
    assert os.listdir(tmp_path) == []  # the key and the script went with the refused job


#: the job waits (PENDING, reason BeginTime) however free the nodes are. A job that fills the nodes
#: would do too, but cancelling one on this one-machine cluster sometimes drains n2 ("Kill task
#: failed": two slurmd on one host), which then breaks every later test.
LATER = ["--begin=now+3600"]


def test_ctrl_c_while_the_job_waits_cancels_it(cluster, g, tmp_path, capsys):
    before = set(cluster.jobs())

    def interrupt_once_pending():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            mine = set(cluster.jobs()) - before
            if mine and cluster.state(mine.pop(), "%T %r") == "PENDING BeginTime":
                time.sleep(2.5)  # the wait shows it (read once a second)
                break
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=interrupt_once_pending)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        nbdist.start(2, on="slurm", nodes=2, timeout=30, sbatch_args=LATER, workdir=str(tmp_path))
    timer.join()
    err = capsys.readouterr().err
    assert "PENDING (BeginTime), waited " in err, err
    assert "(Ctrl-C while its ranks were joining)" in err
    cluster.wait_empty(15.0, keep=before)
    assert g.run(lambda: 1) == [1, 1]  # the shared group's job was not touched


def test_a_job_whose_ranks_cannot_start_says_so_with_its_output(cluster, g, tmp_path):
    before = cluster.jobs()
    with pytest.raises(NbdistError, match=r"(?s)SLURM job \d+ ended before its ranks joined: "
                                          r"(COMPLETED|FAILED).*--- the job's output \(last lines\) "
                                          r"---\n.*/no/such/python.*Check that the nodes have the "
                                          r"same Python, torch and nbdist \(/no/such/python\)"):
        nbdist.start(2, on="slurm", nodes=2, python="/no/such/python", progress=False,
                     workdir=str(tmp_path))
    cluster.wait_empty(15.0, keep=before)


def test_ranks_that_do_not_join_in_time_name_the_jobs_state(cluster, g, tmp_path):
    before = cluster.jobs()
    with pytest.raises(nbdist.DistTimeoutError, match=r"ranks 0, 1 did not join within 3 s.* "
                                                      r"\(SLURM job \d+: PENDING BeginTime\)"):
        nbdist.start(2, on="slurm", nodes=2, join_timeout=3, sbatch_args=LATER, progress=False,
                     workdir=str(tmp_path))
    cluster.wait_empty(15.0, keep=before)


def test_the_magic_starts_a_slurm_group(cluster, g):
    from IPython.testing import globalipapp
    from IPython.testing.globalipapp import start_ipython
    from IPython.utils.capture import capture_output

    from nbdist.ui import magics

    before = cluster.jobs()
    shell = start_ipython() or globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    try:
        magics.use_group(None)
        with capture_output() as out:
            shell.run_line_magic("dist_start", "-n 2 --on slurm --nodes 2 --time 10:00 "
                                               "--sbatch-arg=--job-name=nbdist-magic")
        assert "nbdist: submitted SLURM job" in out.stdout
        group = magics.current_group()
        assert group.exec("import os\nos.environ['SLURM_JOB_NAME']") == ["nbdist-magic"] * 2
        shell.run_line_magic("dist_stop", "")
        cluster.wait_empty(15.0, keep=before)
    finally:
        magics.use_group(None)
        shell.run_line_magic("unload_ext", "nbdist")


KERNEL = textwrap.dedent("""
    import os, sys, time, nbdist
    g = nbdist.start(2, on="slurm", nodes=2, timeout=30, progress=False, workdir=sys.argv[2],
                     sbatch_args=sys.argv[3:])
    assert g.run(lambda: 2) == [2, 2]
    open(os.path.join(sys.argv[2], "ready"), "w").close()
    if sys.argv[1] == "sigkill":
        time.sleep(600)
""")


def _wait_ready(kernel, directory, limit=120.0):
    deadline = time.monotonic() + limit
    while not os.path.exists(os.path.join(directory, "ready")):
        assert kernel.poll() is None, f"the kernel exited with {kernel.returncode}"
        assert time.monotonic() < deadline, "the kernel's group did not start"
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_kernel_that_exits_or_is_killed_leaves_the_queue_empty(cluster, g, tmp_path, how):
    before = cluster.jobs()
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, how, str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(kernel, tmp_path)
        if how == "sigkill":
            assert len(cluster.jobs()) == len(before) + 1
            kernel.kill()
        kernel.wait(60)
        cluster.wait_empty(15.0, keep=before)
    finally:
        kernel.kill()
        kernel.wait()


def test_a_sigkilled_kernel_cancels_its_pending_job(cluster, g, tmp_path):
    before = cluster.jobs()
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, "sigkill", str(tmp_path), *LATER],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(cluster.jobs()) == len(before):
            assert kernel.poll() is None, f"the kernel exited with {kernel.returncode}"
            assert time.monotonic() < deadline, "the kernel did not submit its job"
            time.sleep(0.2)
        kernel.kill()
        kernel.wait(30)
        cluster.wait_empty(15.0, keep=before)  # the owner link cancelled it
    finally:
        kernel.kill()
        kernel.wait()


# ---- last: a node goes down under the shared group -----------------------------------------------
def test_a_node_set_down_is_a_rank_death_naming_the_node_and_slurms_reason(cluster, g):
    assert g.run(lambda: 1) == [1, 1]
    try:
        cluster.scontrol("update", "nodename=n2", "state=down", "reason=nbdist-test-down")
        with pytest.raises(nbdist.RankDiedError) as info:
            g.exec("import time\nfor _ in range(600):\n    time.sleep(0.1)")
        text = str(info.value)
        # whichever rank SLURM's kill reached first, the message names the node that went down,
        # the rank on it and SLURM's reason
        # (and the job's state, "job 7 is NODE_FAIL (NodeDown)", once SLURM has ended it)
        assert re.search(r"SLURM says node n2 \(rank 1\) is \S+: nbdist-test-down", text), text
        assert text.endswith("nbdist does not restart the ranks of a SLURM job: call stop(), then "
                             "nbdist.start(..., on='slurm') again (a new job).")
        assert text.startswith(("rank 0 (node 0: n1, host ", "rank 1 (node 1: n2, host ")), text
        assert g.state == "broken"
    finally:
        cluster.scontrol("update", "nodename=n2", "state=resume")
    cluster.wait_idle("n2")


def test_a_node_whose_slurmd_is_killed_is_a_rank_death_naming_it(cluster, tmp_path):
    before = cluster.jobs()
    g2 = nbdist.start(2, on="slurm", nodes=2, timeout=30, progress=False, workdir=str(tmp_path))
    pid_file = cluster.dir / "d-n2.pid"
    try:
        assert g2.run(lambda: 1) == [1, 1]
        os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
        # SLURM notices after SlurmdTimeout (10 s here), sets n2 down and ends the job's steps
        with pytest.raises(nbdist.RankDiedError) as info:
            g2.exec("import time\nfor _ in range(1200):\n    time.sleep(0.1)")
        text = str(info.value)
        assert re.search(r"SLURM says node n2 \(rank 1\) is \S+: Not responding", text), text
    finally:
        g2.stop()
        subprocess.run(["slurmd", "-f", str(cluster.dir / "slurm.conf"), "-N", "n2"],
                       timeout=30, check=True)
        # a node down for "Not responding" comes back when its slurmd registers again
        # (ReturnToService=1); resume it in case it was not marked down yet
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], timeout=30,
                       capture_output=True)
    cluster.wait_idle("n2")
    cluster.wait_empty(15.0, keep=before)
