"""``nbdist.start(on="ray")`` on a real two-node Ray (issue 37): one ``ray.cluster_utils.Cluster``
for the module (:mod:`ray_helpers`: a head and a second node, one CPU each); the module skips,
saying why, where Ray is not installed.

One group (two ranks, STRICT_SPREAD: one per node) serves the feature tests -- the same worker as
every group, so ``%%dist``, a background job, stacks, the collective benchmark and a Lightning fit
work on it. Other tests ask for too much (refused in bounded time, nothing left placed) and play a
kernel in a subprocess that exits or is SIGKILLed (Ray's state API then shows none of its actors
or placement groups), a kernel connected only as a Ray Client (``ray://``, served by the head),
and one whose group has ``keep_alive``: reattached with its variables, or
left until keep_alive passes (then nothing is left either). The last test removes the second node under the shared group: a
``RankDiedError`` naming the rank and the Ray node."""
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import cloudpickle
import pytest
import torch

if sys.platform == "win32":
    pytest.skip("Ray's multi-node test cluster (ray.cluster_utils.Cluster) does not run on Windows",
                allow_module_level=True)
ray = pytest.importorskip("ray", reason="Ray is not installed here (pip install 'nbdist[ray]')")

import nbdist  # noqa: E402
from nbdist.errors import NbdistError  # noqa: E402
from engine_checks import lightning_fit_one_epoch, magic_cell_job_and_stacks  # noqa: E402
from ray_helpers import LocalRay, cluster_env, live, workers  # noqa: E402

# the cluster's own processes come and go between tests (Ray's worker pool): the module checks
# what it starts itself (no_stray_ranks below; LocalRay.stop for the cluster)
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.allow_leaks("the module's Ray cluster (ended and checked at its end)")]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file
SHARED = 0.5  #: CPUs per rank of the shared group (half of each node's one)
SMALL = 0.1  #: CPUs per rank of the groups beside it


@pytest.fixture(scope="module")
def cluster():
    c = LocalRay()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def g(cluster):
    """Two ranks, one on each node (STRICT_SPREAD), half a CPU each."""
    group = nbdist.start(2, on="ray", num_cpus=SHARED, placement="STRICT_SPREAD", timeout=30,
                         progress=False)
    try:
        yield group
    finally:
        nbdist.use_group(None)
        group.stop()


@pytest.fixture(autouse=True)
def no_stray_ranks(cluster):
    """No worker a test started outlives it (the shared group's are there before and after)."""
    before = workers()
    yield
    deadline = time.monotonic() + 15.0
    while workers() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not workers() - before, "a Ray rank's worker outlived its test"


def test_strict_spread_puts_the_ranks_on_different_nodes_with_torchruns_variables(cluster, g):
    assert (g.backend, g.device) == ("gloo", "cpu")
    env = g.exec("import os\n[os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
                 "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'GROUP_WORLD_SIZE', 'CUDA_VISIBLE_DEVICES')]")
    assert env == [["0", "0", "2", "1", "0", "2", ""], ["1", "0", "2", "1", "1", "2", ""]]
    nodes = g.exec("import os\nos.environ['NBDIST_RAY_NODE_ID']")
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(set(nodes)) == 2 and set(nodes) == alive and nodes == sorted(nodes)
    assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
        [[3.0, 3.0]] * 2
    assert [r.node for r in g.status().ranks] == ["0", "1"]
    with pytest.raises(nbdist.RemoteError, match=rf"ValueError on rank 1 \(node 1: Ray node "
                                                 rf"{nodes[1][:8]}, host "):
        g.exec("if rank == 1:\n    raise ValueError('boom')")
    with pytest.raises(nbdist.GroupClosedError, match="a Ray group run in its actors; nbdist "
                                                      "does not restart them"):
        g.restart()


def test_dist_magic_a_background_job_and_stacks(g):
    magic_cell_job_and_stacks(g, "on_ray")


def test_collective_benchmark(g):
    out = nbdist.bench.collectives(g, ops="all_reduce", sizes="4K", iters=2, warmup=1,
                                   progress=False)
    assert [r["status"] for r in out] == ["ok"]


def test_lightning_fit(g, tmp_path):
    lightning_fit_one_epoch(g, tmp_path)


def _job() -> str:
    return ray.get_runtime_context().get_job_id()


def test_asking_for_too_much_fails_clearly_and_leaves_nothing_placed(g):
    with pytest.raises(NbdistError, match=r"Ray could not place 2 bundles of CPU 2 \(PACK\) "
                                          r"within 3 s; the cluster has 2 nodes and free CPU 1, "
                                          r"memory .*\(of CPU 2, memory .*\)\. Ask for fewer "
                                          r"ranks or less per rank, or raise placement_timeout "
                                          r".* The placement group was removed\."):
        nbdist.start(2, on="ray", num_cpus=2, placement_timeout=3, progress=False)
    with pytest.raises(NbdistError, match=r"3 bundles of CPU 0\.1 \(STRICT_SPREAD\) .* or "
                                          r"PACK/SPREAD \(STRICT_SPREAD needs a node per rank\)"):
        nbdist.ray.start(3, num_cpus=SMALL, placement="STRICT_SPREAD", placement_timeout=3,
                         progress=False)
    deadline = time.monotonic() + 30
    while len(live(_job())[1]) > 1:  # the shared group's only
        assert time.monotonic() < deadline, live(_job())
        time.sleep(0.5)
    assert g.run(lambda: 1) == [1, 1]


def test_a_blocked_address_is_named_with_its_usual_causes(g):
    # the launch's own steps (place, one actor per bundle, preflight) against a port nothing
    # listens on, standing in for one a firewall or a NetworkPolicy blocks
    from nbdist.engines import ray_session
    from nbdist.engines.ray import RayEngine

    launcher = RayEngine().launcher(2, num_cpus=SMALL, progress=False)
    launcher._session = ray_session.connect(None)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    try:
        with pytest.raises(NbdistError, match=rf"the Ray actors cannot connect to this notebook "
                                              rf"at 127.0.0.1:{port} \(blocked: rank 0 on Ray "
                                              r"node \w{8} \(\S+\): ConnectionRefusedError.*; "
                                              r"rank 1 .*\)\. The usual causes: the notebook runs "
                                              r"outside the cluster's network \(the Ray Client.*"
                                              r"on KubeRay, a NetworkPolicy"):
            launcher.listening("127.0.0.1", port, 2)
    finally:
        launcher.close()
    assert len(live(_job())[0]) == 2  # the shared group's actors only
    assert g.run(lambda: 1) == [1, 1]


def test_actors_that_cannot_start_say_so(g):
    with pytest.raises(NbdistError, match=r"the Ray actors of the ranks did not start: .*"
                                          r"/no/such/dir.*\nnbdist \(this version, with torch\) "
                                          r"must be importable on the Ray nodes"):
        nbdist.ray.start(2, num_cpus=SMALL, runtime_env={"working_dir": "/no/such/dir"},
                         progress=False)
    assert len(live(_job())[1]) == 1  # the shared group's placement group only


KERNEL = textwrap.dedent("""
    import os, sys, time
    import ray, nbdist
    ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
    g = nbdist.start(2, on="ray", num_cpus=0.1, timeout=30, progress=False)
    assert g.run(lambda: 2) == [2, 2]
    with open(os.path.join(sys.argv[3], "ready.tmp"), "w") as f:
        f.write(ray.get_runtime_context().get_job_id())
    os.rename(os.path.join(sys.argv[3], "ready.tmp"), os.path.join(sys.argv[3], "ready"))
    while not os.path.exists(os.path.join(sys.argv[3], "go")):  # the test has looked
        time.sleep(0.1)
    if sys.argv[2] == "sigkill":
        time.sleep(600)
""")


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_a_kernel_that_exits_or_is_killed_leaves_no_actor_and_no_placement_group(
        cluster, g, tmp_path, how):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, cluster.address, how, str(tmp_path)],
                              env=dict(os.environ, **cluster_env()), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        ready = tmp_path / "ready"
        deadline = time.monotonic() + 180
        while not ready.exists():
            assert kernel.poll() is None, kernel.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the kernel's group did not start"
            time.sleep(0.2)
        job = ready.read_text()
        actors, groups = live(job)
        assert (len(actors), len(groups)) == (2, 1)
        (tmp_path / "go").touch()
        if how == "sigkill":
            kernel.kill()
        kernel.wait(60)
        deadline = time.monotonic() + 60
        while live(job) != ([], []):
            assert time.monotonic() < deadline, f"left behind: {live(job)}"
            time.sleep(0.5)
    finally:
        kernel.kill()
        kernel.wait()
        kernel.stderr.close()
    assert g.run(lambda: 1) == [1, 1]  # the shared group was not touched


CLIENT = textwrap.dedent("""
    import os, sys
    import ray, nbdist
    g = nbdist.start(2, on="ray", address=sys.argv[1], num_cpus=0.1, placement="STRICT_SPREAD",
                     timeout=30, progress=False)
    assert ray.util.client.ray.is_connected()  # the kernel is a Ray Client, not a driver
    print("nodes", len({p["node_id"] for p in g._launcher.places}))
    print("sum", g.exec("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()"))
    print("stacks", "no answer" not in str(g.stacks(timeout=10)))
    print("job", ray.get_runtime_context().get_job_id(), flush=True)
    sys.stdin.readline()  # the test has seen the actors
    g.stop()
    print("connected_after_stop", ray.is_initialized())
""")


def test_a_kernel_on_the_ray_client_starts_a_group_and_its_stop_leaves_nothing(cluster, g):
    kernel = subprocess.Popen(
        [sys.executable, "-c", CLIENT, f"ray://127.0.0.1:{cluster.client_port}"],
        env=dict(os.environ, **cluster_env()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        said = {}
        for line in kernel.stdout:  # ends with the job line, or at EOF if the kernel failed
            said.update([line.strip().split(" ", 1)] if " " in line else [])
            if "job" in said:
                break
        assert "job" in said, kernel.stderr.read()[-3000:]
        assert said["nodes"] == "2" and said["sum"] == "[3.0, 3.0]" and said["stacks"] == "True"
        actors, groups = live(said["job"])
        assert (len(actors), len(groups)) == (2, 1)  # Ray's state API sees the client's group
        out, err = kernel.communicate("go\n", timeout=120)
        assert kernel.returncode == 0, err[-3000:]
        assert "connected_after_stop False" in out  # nbdist connected, so nbdist disconnected
    finally:
        kernel.kill()
        kernel.wait()
    deadline = time.monotonic() + 60
    while live(said["job"]) != ([], []):
        assert time.monotonic() < deadline, f"left behind: {live(said['job'])}"
        time.sleep(0.5)
    assert g.run(lambda: 1) == [1, 1]  # the shared group was not touched


KEPT = textwrap.dedent("""
    import os, sys
    import ray, nbdist
    g = nbdist.ray.start(2, num_cpus=0.1, address=sys.argv[1], keep_alive=sys.argv[2],
                         timeout=30, progress=False)
    g.exec("x = rank * 10 + 7")
    with open(os.path.join(sys.argv[3], "ready.tmp"), "w") as f:
        f.write(ray.get_runtime_context().get_job_id())
    os.rename(os.path.join(sys.argv[3], "ready.tmp"), os.path.join(sys.argv[3], "ready"))
    os.kill(os.getpid(), 9)
""")


def kept_group(cluster, tmp_path, keep_alive):
    """A kernel in a subprocess starts a keep_alive group on the cluster, sets ``x`` on its
    ranks and is SIGKILLed; the Ray job id of that kernel."""
    done = subprocess.run([sys.executable, "-c", KEPT, cluster.address, keep_alive,
                           str(tmp_path)], env=dict(os.environ, **cluster_env()),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == -9 and (tmp_path / "ready").exists(), done.stderr[-3000:]
    return (tmp_path / "ready").read_text()


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """Jupyter's runtime directory (where handles go) of this test alone, for the kernel too."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return tmp_path / "runtime"


def test_keep_alive_the_ranks_outlive_a_killed_kernel_and_reattach_takes_them_back(
        cluster, g, tmp_path, runtime_dir):
    job = kept_group(cluster, tmp_path, "120")
    actors, groups = live(job)
    assert (len(actors), len(groups)) == (2, 1)  # detached: the kernel's death left them
    [handle] = runtime_dir.glob("nbdist-ray-*.json")
    kept = nbdist.reattach(progress=False, join_timeout=60)
    try:
        assert kept.exec("x") == [7, 17]  # the first kernel's variables
        assert kept.exec("pg = dist.new_group([0, 1]); t = torch.ones(1) * (rank + 1); "
                         "dist.all_reduce(t, group=pg); t.item()") == [3.0, 3.0]
    finally:
        kept.stop()
    assert live(job) == ([], [])  # stop() removed the detached actors and placement group
    assert not handle.exists()
    assert g.run(lambda: 1) == [1, 1]  # the shared group was not touched


def test_keep_alive_passes_the_ranks_exit_and_nothing_is_left(cluster, g, tmp_path,
                                                              runtime_dir):
    job = kept_group(cluster, tmp_path, "3s")
    deadline = time.monotonic() + 90
    while live(job) != ([], []):  # the actors removed themselves and the placement group
        assert time.monotonic() < deadline, f"left behind: {live(job)}"
        time.sleep(0.5)
    with pytest.raises(NbdistError, match=r"reattach\(\): the saved group's job has ended \(the "
                                          r"Ray group nbdist-\w+ has 0 of its 2 actors and no "
                                          r"placement group\); .* Start a new group, e\.g\. "
                                          r"nbdist\.start\(2, on='ray', keep_alive='30m'\)"):
        nbdist.reattach(progress=False)
    assert list(runtime_dir.glob("nbdist-ray-*.json")) == []
    assert g.run(lambda: 1) == [1, 1]


# ---- last: the second node goes under the shared group -------------------------------------------
def test_a_removed_node_is_a_rank_death_naming_the_rank_and_the_node(cluster, g):
    nodes = g.exec("import os\nos.environ['NBDIST_RAY_NODE_ID']")
    gone = cluster.second.node_id
    rank = nodes.index(gone)
    cluster.cluster.remove_node(cluster.second)
    with pytest.raises(nbdist.RankDiedError) as info:
        g.exec("import time\nfor _ in range(600):\n    time.sleep(0.1)")
    text = str(info.value)
    assert re.search(rf"rank {rank} \(node {rank}: Ray node {gone[:8]}, host ", text), text
    assert f"Ray says node {gone[:8]} (rank {rank}) is dead" in text, text
    assert text.endswith("nbdist does not restart the ranks of a Ray group: call stop(), then "
                         "nbdist.start(..., on='ray') again."), text
    assert g.state == "broken"
