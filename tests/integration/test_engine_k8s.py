"""``nbdist.start(on="k8s")`` end to end, without a cluster (none can be had on these machines):
kmock emulates the API server, :class:`k8s_helpers.Controller` plays the Job controller and the
kubelet, running every pod of the Job as local ``python -m nbdist.worker`` processes from the
pod template -- the environment, the index and the mounted Secret resolved.

The notebook "runs in a pod": the service account's namespace file and the notebook pod exist, so
the image, the namespace, the owner reference and the IP the ranks dial come from that pod. One
group serves the feature tests (torchrun's variables, the key from the Secret, signing, a
collective, stop deleting everything); others: the wait shown with the scheduler's reason and
Ctrl-C deleting what was created, a preflight that cannot connect, a pod that fails before
joining, and a SIGKILLed kernel whose ranks exit by themselves. With ``keep_alive`` a subprocess
plays the first kernel (SIGKILLed, or exiting through its atexit handlers) and this process the
next one, which reattaches; or keep_alive passes, the ranks exit and reattach() says so."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch  # noqa: F401 -- imported before any Ctrl-C test: a SIGINT mid-import breaks torch
from k8s_helpers import Controller, Emulator
from threaded import ctrl_c_elsewhere

import nbdist
from nbdist.engines import k8s_api
from nbdist.errors import NbdistError

pytestmark = pytest.mark.timeout(300)
NOTEBOOK = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "jupyter-alice", "namespace": "team"},
            "spec": {"containers": [{"name": "notebook", "image": "registry.example/nb:1.2"}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The emulated API server, a kubeconfig for it, and this process as the notebook pod."""
    home = tmp_path_factory.mktemp("k8s")
    em = Emulator()
    (home / "sa").mkdir()
    (home / "sa" / "namespace").write_text("team")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(em.kubeconfig(home / "kubeconfig")))
        mp.setenv("HOSTNAME", "jupyter-alice")
        mp.setattr(k8s_api, "SERVICE_ACCOUNT_DIR", str(home / "sa"))
        from kubernetes import client

        created = client.CoreV1Api(em.api()).create_namespaced_pod("team", NOTEBOOK)
        em.notebook_uid = created.metadata.uid
        try:
            yield em
        finally:
            em.stop()


@pytest.fixture
def controller(cluster):
    c = Controller(cluster)
    try:
        yield c
    finally:
        c.stop()


def group_objects(cluster, settle=30.0):
    """The group's objects left, once the emulated garbage collector took the pods of a deleted
    Job (kmock deletes a Job at once; a cluster keeps it until its pods are gone)."""
    deadline = time.monotonic() + settle
    while time.monotonic() < deadline and any(
            n.startswith("nbdist-") for (_, n) in cluster.stored("pods")):
        time.sleep(0.1)
    return {kind: sorted(n for (ns, n) in cluster.stored(kind) if n.startswith("nbdist-"))
            for kind in ("jobs", "services", "secrets", "pods")}


NOTHING = {"jobs": [], "services": [], "secrets": [], "pods": []}


def test_ranks_from_the_job_join_with_the_key_from_the_secret_and_stop_deletes_it_all(
        cluster, controller, capsys):
    g = nbdist.start(2, on="k8s", timeout=30, protect=True, resources={"cpu": "1"})
    try:
        name = f"nbdist-{g.id}"
        job = cluster.stored("jobs")[("team", name)]
        # defaults from the notebook's pod: its image, its namespace, owned by it
        assert job["spec"]["template"]["spec"]["containers"][0]["image"] == \
            "registry.example/nb:1.2"
        assert job["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod",
                                                      "name": "jupyter-alice",
                                                      "uid": cluster.notebook_uid}]
        for kind in ("services", "secrets"):
            (obj,) = [o for (ns, n), o in cluster.stored(kind).items() if n.startswith(name)]
            assert obj["metadata"]["ownerReferences"] == [
                {"apiVersion": "batch/v1", "kind": "Job", "name": name,
                 "uid": job["metadata"]["uid"]}]
        # created suspended, resumed once the Secret and the Service existed
        assert [r.data for r in cluster.requests("patch", f"/jobs/{name}")
                if str(r.url.path).endswith(name)][0] == {"spec": {"suspend": False}}
        env = g.exec("import os\n[os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
                     "'LOCAL_WORLD_SIZE', 'GROUP_RANK')]")
        assert env == [["0", "0", "2", "1", "0"], ["1", "0", "2", "1", "1"]]
        # the key came from the mounted Secret, never from the spec or the environment
        key_hex = open(g._launcher.key_file).read().strip()
        assert g.exec("import sys; open(sys.argv[sys.argv.index('--key-file') + 1]).read()"
                      ".strip()") == [key_hex] * 2
        assert key_hex not in str(job)
        assert all(key_hex not in v for v in g.exec("import os; list(os.environ.values())")[0])
        assert g.exec("t = torch.ones(2) * (rank + 1); dist.all_reduce(t); t.tolist()") == \
            [[3.0, 3.0]] * 2
        with pytest.raises(nbdist.GroupClosedError, match="a Kubernetes group run in its Job"):
            g.restart()
        out = capsys.readouterr().out
        assert f"created Kubernetes Job team/{name} for 2 ranks" in out
    finally:
        g.stop()
    assert group_objects(cluster) == NOTHING
    deletes = {r.url.path.split("/")[-2]: r.params for r in cluster.requests("delete", name)
               if r.url.path.split("/")[-2] != "pods"}  # those are the garbage collector's
    assert deletes == {kind: {"propagationPolicy": "Foreground"}
                       for kind in ("jobs", "services", "secrets")}
    assert controller.wait_exited(60)


def test_the_wait_shows_the_schedulers_reason_and_ctrl_c_deletes_everything(cluster, capsys):
    waiting = Controller(cluster, run=False)

    def interrupt_when_shown():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(
                n.startswith("nbdist-") and "preflight" not in n
                for (_, n) in cluster.stored("pods")):
            time.sleep(0.2)
        time.sleep(2.5)  # read once a second
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Thread(target=interrupt_when_shown)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            nbdist.k8s.start(2, preflight=False, timeout=30)
        assert group_objects(cluster) == NOTHING
    finally:
        timer.join()
        waiting.stop()
    err = capsys.readouterr().err
    assert "0 of 2 pods Running, waiting: Unschedulable: 0/3 nodes are available: 3 " \
           "Insufficient cpu." in err, err
    assert "deleted Kubernetes Job nbdist-" in err and "(Ctrl-C while its ranks were joining)" \
        in err


def test_a_ctrl_c_another_thread_received_ends_a_preflight_whose_pod_never_comes(cluster):
    """No controller: the preflight Job's pod is never made, as for a pod Pending for good. Was:
    the wait went on until join_timeout when the OS gave the SIGINT to another thread."""
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_elsewhere(2.0):
            nbdist.start(2, on="k8s", timeout=30, progress=False, join_timeout=120)
    assert time.monotonic() - began < 60  # (was: the whole join_timeout)
    assert group_objects(cluster) == NOTHING


def test_a_preflight_that_cannot_connect_names_the_usual_causes(cluster):
    blocked = Controller(cluster, blocked=True)
    try:
        with pytest.raises(NbdistError, match=r"(?s)the preflight Job team/nbdist-\w+-preflight "
                                              r"\(pod nbdist-\w+-preflight-0-x0\) could not "
                                              r"connect back to this notebook at 127.0.0.1:\d+ "
                                              r"\(Error, exit code 1\); no Job was created for "
                                              r"the ranks.*cannot reach the notebook.*"
                                              r"singleuser.networkPolicy.*Istio sidecar"):
            nbdist.start(2, on="k8s", timeout=30, progress=False)
    finally:
        blocked.stop()
    assert group_objects(cluster) == NOTHING


def test_a_pod_that_fails_before_joining_ends_the_wait_with_its_last_lines(cluster, controller):
    with pytest.raises(NbdistError, match=r"(?s)Kubernetes Job nbdist-\w+ failed before its ranks "
                                          r"joined: pod nbdist-\w+-\d-x\d: Error, exit code 1.*"
                                          r"No module named nbdist_is_not_in_this_image"):
        _start_broken()
    assert group_objects(cluster) == NOTHING
    assert controller.wait_exited(60)


def _start_broken():
    # a worker module the "image" lacks: python -m fails at once, as a wrong image would
    from nbdist.engines import k8s_manifests

    real = k8s_manifests._pod_spec

    def broken(*args):
        spec = real(*args)
        spec["containers"][0]["command"][2] = "nbdist_is_not_in_this_image"
        return spec

    k8s_manifests._pod_spec = broken
    try:
        return nbdist.start(2, on="k8s", timeout=30, progress=False, preflight=False)
    finally:
        k8s_manifests._pod_spec = real


KERNEL = textwrap.dedent("""
    import os, sys, time
    import nbdist
    from nbdist.engines import k8s_api
    k8s_api.SERVICE_ACCOUNT_DIR = sys.argv[1]
    g = nbdist.start(2, on="k8s", timeout=30, progress=False, preflight=False)
    print("ready", g.id, flush=True)
    time.sleep(600)
""")


def test_a_sigkilled_kernel_ends_its_ranks_and_the_ttl_is_set(cluster, controller, tmp_path):
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "namespace").write_text("team")
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, str(sa)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  p for p in sys.path if p)))
    try:
        line = kernel.stdout.readline()
        assert line.startswith("ready "), line
        name = f"nbdist-{line.split()[1]}"
        assert len(controller.running()) == 2
    finally:
        kernel.kill()
        kernel.wait()
        kernel.stdout.close()
    assert controller.wait_exited(120), controller.running()  # they exit on a lost controller
    job = cluster.stored("jobs")[("team", name)]
    assert job["spec"]["ttlSecondsAfterFinished"] == 600  # Kubernetes removes it from here
    assert job["status"]["conditions"][0]["type"] in ("Failed", "Complete")
    # what the TTL controller would do, so the next tests start clean
    from kubernetes import client

    client.BatchV1Api(cluster.api()).delete_namespaced_job(name, "team")
    time.sleep(0.5)


#: a first kernel whose group has keep_alive: a variable on the ranks, then SIGKILLed or exited
KEEP_KERNEL = textwrap.dedent("""
    import os, sys
    import nbdist
    from nbdist.engines import k8s_api
    k8s_api.SERVICE_ACCOUNT_DIR = sys.argv[1]
    g = nbdist.start(2, on="k8s", keep_alive=sys.argv[2], timeout=30, progress=False,
                     preflight=False)
    g.exec("x = rank * 10 + 7")
    print("READY", g.id, flush=True)
    if sys.argv[3] == "sigkill":
        os.kill(os.getpid(), 9)
""")


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    """Jupyter's runtime directory (the handle goes there), of this test alone."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return tmp_path / "runtime"


def keep_alive_kernel(tmp_path, keep_alive, how):
    """Run the first kernel to its end (``"sigkill"``, or ``"exit"``: its atexit handlers run);
    the name of its group's Job."""
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "namespace").write_text("team")
    done = subprocess.run([sys.executable, "-c", KEEP_KERNEL, str(sa), keep_alive, how],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path
                                                                          if p)))
    assert done.returncode == (-9 if how == "sigkill" else 0) and "READY" in done.stdout, \
        f"the first kernel: {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    if how == "exit":
        assert "keeps its ranks for 120 s (keep_alive)" in done.stderr, done.stderr[-3000:]
    return "nbdist-" + done.stdout.split("READY ")[1].split()[0]


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_a_keep_alive_job_outlives_its_kernel_and_reattach_takes_its_ranks_back(
        cluster, controller, runtime, tmp_path, how):
    name = keep_alive_kernel(tmp_path, "120", how)
    # the kernel is gone, its Job is not: its ranks wait for the next kernel
    assert ("team", name) in cluster.stored("jobs") and len(controller.running()) == 2
    (handle_file,) = runtime.glob("nbdist-k8s-*.json")
    handle = json.loads(handle_file.read_text())
    assert (handle["engine"], handle["job"], handle["namespace"]) == ("k8s", name, "team")
    assert handle["address"][0] == "127.0.0.1"  # the notebook pod's IP
    g = nbdist.reattach(progress=False, join_timeout=60)
    try:
        assert g.exec("x") == [7, 17]  # the first kernel's variables
        assert g.exec("pg = dist.new_group([0, 1]); t = torch.ones(1) * (rank + 1); "
                      "dist.all_reduce(t, group=pg); t.item()") == [3.0, 3.0]
        job = cluster.stored("jobs")[("team", name)]
        assert job["metadata"]["ownerReferences"][0]["name"] == "jupyter-alice"
        assert job["spec"]["activeDeadlineSeconds"] == 24 * 3600 + 120
    finally:
        g.stop()
    assert group_objects(cluster) == NOTHING  # stop() after reattach deletes it all
    assert controller.wait_exited(60)
    assert not handle_file.exists()


def test_keep_alive_passes_the_ranks_exit_and_reattach_says_the_job_ended(
        cluster, controller, runtime, tmp_path):
    name = keep_alive_kernel(tmp_path, "3s", "sigkill")
    assert controller.wait_exited(60), controller.running()  # no kernel came back in time
    job = cluster.stored("jobs")[("team", name)]
    assert job["status"]["conditions"][0]["type"] == "Complete"  # they exited 0: done
    with pytest.raises(NbdistError, match=rf"reattach\(\): the saved group's job has ended "
                                          rf"\(Kubernetes Job team/{name} is Complete\); its "
                                          r"ranks and their variables are gone \(handle .* "
                                          r"removed\)\. Start a new group, e\.g\. nbdist\.start"
                                          r"\(2, on='k8s', keep_alive='30m'\)\."):
        nbdist.reattach(progress=False)
    assert not list(runtime.glob("nbdist-k8s-*.json"))
    # what the TTL controller would do; then Kubernetes no longer knows the Job
    from kubernetes import client

    client.BatchV1Api(cluster.api()).delete_namespaced_job(name, "team")
    time.sleep(0.5)
    assert nbdist.engines.k8s.K8sEngine.ended({"namespace": "team", "job": name}) == \
        f"Kubernetes no longer has Job team/{name}"
