"""Every call ``on="k8s"`` makes, against kmock's emulation of the API server (the real
``kubernetes`` client, real HTTP): what is sent (label selectors, foreground propagation), and
how the API's refusals come back (a 403 naming the Role the notebook needs, a notebook pod that
cannot be read). No process is started here; ``test_engine_k8s`` runs the ranks."""
import pytest
from k8s_helpers import Emulator

from nbdist.engines import k8s_api
from nbdist.engines.k8s_api import Api, ended_reason, waiting_reason
from nbdist.errors import NbdistError

FORBIDDEN = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
             "code": 403, "message": 'jobs.batch is forbidden: User "system:serviceaccount:team:'
                                     'default" cannot create resource "jobs" in API group "batch"'}


@pytest.fixture(scope="module")
def em():
    e = Emulator()
    try:
        yield e
    finally:
        e.stop()


@pytest.fixture
def api(em, tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(em.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setattr(k8s_api, "SERVICE_ACCOUNT_DIR", str(tmp_path / "sa"))
    return Api()


def pod(name, labels, **status):
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "team",
                                                           "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]}, "status": status}


def test_the_namespace_comes_from_the_kubeconfig_outside_a_pod(api):
    assert api.default_namespace() == "team"
    assert api.own_pod() is None


def test_create_returns_the_object_with_its_uid_and_delete_is_foreground(api, em):
    made = api.create(pod("p1", {"a": "1"}))
    assert made["metadata"]["uid"]
    assert api.delete("Pod", "team", "p1") is True
    assert em.requests("delete", "/pods/p1")[-1].params == {"propagationPolicy": "Foreground"}
    assert api.delete("Pod", "team", "p1") is False  # already gone: not an error
    assert api.pod("team", "p1") is None and api.job("team", "nope") is None


def test_pods_are_listed_by_label_selector(api, em):
    api.create(pod("mine", {"app.kubernetes.io/instance": "g1", "app.kubernetes.io/component":
                            "ranks"}))
    api.create(pod("other", {"app.kubernetes.io/instance": "g2"}))
    try:
        got = api.pods("team", "app.kubernetes.io/instance=g1,app.kubernetes.io/component=ranks")
        assert [p["metadata"]["name"] for p in got] == ["mine"]
        assert em.requests("get", "/namespaces/team/pods")[-1].params == {
            "labelSelector": "app.kubernetes.io/instance=g1,app.kubernetes.io/component=ranks"}
    finally:
        api.delete("Pod", "team", "mine")
        api.delete("Pod", "team", "other")


def test_a_forbidden_create_names_the_role_the_notebook_needs(api, em):
    em.handler["post /apis/batch/v1/namespaces/team/jobs"] << 403 << FORBIDDEN
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "team"}}
    with pytest.raises(NbdistError, match=r"Kubernetes refused to create Job team/j: jobs.batch "
                                          r"is forbidden: .*; the notebook's service account "
                                          r"needs the Role in docs/multinode.md"):
        api.create(job)


def test_a_notebook_pod_that_cannot_be_read_says_what_to_do(api, tmp_path, monkeypatch):
    (tmp_path / "sa").mkdir()
    (tmp_path / "sa" / "namespace").write_text("team")
    monkeypatch.setenv("HOSTNAME", "jupyter-nobody")
    with pytest.raises(NbdistError, match=r"could not read this notebook's pod "
                                          r"team/jupyter-nobody \(.*\): the notebook's service "
                                          r"account needs the Role .*; or pass image= and "
                                          r"namespace=."):
        api.own_pod()


def test_the_log_of_a_pod_and_the_reasons_kubernetes_gives():
    unschedulable = {"status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 node(s) had untolerated taint "
                   "{nvidia.com/gpu: present}."}]}}
    assert waiting_reason(unschedulable) == ("Unschedulable: 0/4 nodes are available: 4 node(s) "
                                             "had untolerated taint {nvidia.com/gpu: present}.")
    pulling = {"status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "nb:typo"'}}}]}}
    assert waiting_reason(pulling) == 'ImagePullBackOff: Back-off pulling image "nb:typo"'
    creating = {"status": {"phase": "Pending", "containerStatuses": [{"state": {"waiting": {
        "reason": "ContainerCreating"}}}]}}
    assert waiting_reason(creating) == "Pending"
    oom = {"status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {
        "reason": "OOMKilled", "exitCode": 137}}}]}}
    assert ended_reason(oom) == "OOMKilled, exit code 137"
    evicted = {"status": {"phase": "Failed", "reason": "Evicted",
                          "message": "The node was low on resource: memory."}}
    assert ended_reason(evicted) == "Evicted: The node was low on resource: memory."
