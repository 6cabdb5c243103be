"""``nbdist.k8s.manifests``: the objects ``on="k8s"`` creates, checked offline -- against
Kubernetes' OpenAPI schemas (``kubernetes-validate``, strict: an unknown field fails) for every
release it knows from 1.25 on, against a golden file, and for the bad input refused before
anything is created. No cluster and no client are needed (image and namespace are given)."""
import base64
from pathlib import Path

import pytest

import nbdist
from nbdist.engines import k8s_api
from nbdist.engines.k8s_manifests import KEY_DIR, build

GOLDEN = Path(__file__).parent / "golden" / "k8s_manifests.yaml"
GPU_TAINT = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(autouse=True)
def outside_a_pod(monkeypatch, tmp_path):
    monkeypatch.setattr(k8s_api, "SERVICE_ACCOUNT_DIR", str(tmp_path / "no-service-account"))


def example(**kw):
    opts = dict(image="ghcr.io/example/nb:2.13", namespace="team", gpus=2, nodes=2,
                node_selector={"pool": "gpu"}, tolerations=[GPU_TAINT],
                service_account="trainer", env={"HF_HOME": "/cache"},
                listen="10.0.0.5:29400")
    opts.update(kw)
    return nbdist.k8s.manifests(4, **opts)


def test_the_manifests_match_the_golden_file():
    pytest.importorskip("yaml", reason="PyYAML is not installed (it comes with nbdist[k8s])")
    # to update after a deliberate change: write example().yaml to GOLDEN and review the diff
    assert example().yaml == GOLDEN.read_text()


@pytest.mark.parametrize("per_node", [1, 2])
def test_every_object_is_valid_for_every_kubernetes_release_from_1_25(per_node):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not "
                                                           "installed: pip install -e '.[dev]'")
    m = example(nodes=4 // per_node, gpus=per_node)
    real = build("nbdist-ab12cd34", "team", "img", "10.0.0.5:4242", 4, 4 // per_node, per_node,
                 {"cpu": "2"}, 0, None, None, None, {}, {"apiVersion": "v1", "kind": "Pod",
                                                         "name": "jupyter-a", "uid": "u-1"},
                 "python", 60, 600, True, key_hex="ab" * 32)
    versions = [v for v in ("1.25.0", "1.28.0", "1.31.0", "1.34.0", "1.37.0")]
    for obj in list(m) + list(real):
        for version in versions:
            kv.validate(obj, version, strict=True)
    with pytest.raises(kv.ValidationError, match="'zero' is not of type 'integer'"):
        kv.validate(dict(m.job, spec=dict(m.job["spec"], backoffLimit="zero")), "1.37.0",
                    strict=True)


def test_the_job_is_indexed_bounded_and_holds_no_key():
    m = example()
    spec = m.job["spec"]
    assert (spec["completions"], spec["parallelism"], spec["completionMode"],
            spec["backoffLimit"], spec["ttlSecondsAfterFinished"],
            spec["activeDeadlineSeconds"]) == (2, 2, "Indexed", 0, 600, 86400)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == m.service["metadata"]["name"] == m.name
    assert m.service["spec"]["clusterIP"] == "None"
    (mount,) = [v for v in pod["containers"][0]["volumeMounts"] if v["mountPath"] == KEY_DIR]
    assert mount["readOnly"] is True
    assert pod["volumes"][0]["secret"]["secretName"] == m.secret["metadata"]["name"]
    assert pod["containers"][0]["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "2"}
    key_hex = "cd" * 32
    real = build("nbdist-x", "team", "img", "10.0.0.5:4242", 2, 2, 1, {}, 0, None, None, None,
                 {}, None, "python", 60, 600, False, key_hex=key_hex)
    assert base64.b64decode(real.secret["data"]["key.hex"]).decode() == key_hex
    assert key_hex not in str(real.job) and real.preflight is None
    assert real.job["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "python", "-m", "nbdist.worker", "--connect", "10.0.0.5:4242", "--key-file",
        f"{KEY_DIR}/key.hex"]


def test_a_keep_alive_job_differs_only_by_a_deadline_that_leaves_the_ranks_that_time():
    plain, kept = example(), example(keep_alive="30m")
    assert kept.job["spec"]["activeDeadlineSeconds"] == 24 * 3600 + 1800
    assert dict(kept.job, spec=dict(kept.job["spec"], activeDeadlineSeconds=86400)) == plain.job
    assert [kept.secret, kept.service, kept.preflight] == [plain.secret, plain.service,
                                                          plain.preflight]
    # a deadline given is kept (it must leave keep_alive room: see the bad options)
    assert example(keep_alive=600, active_deadline=7200).job["spec"]["activeDeadlineSeconds"] \
        == 7200
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not "
                                                           "installed: pip install -e '.[dev]'")
    kv.validate(kept.job, "1.37.0", strict=True)


def test_the_preflight_is_a_job_that_cleans_up_after_itself():
    """A kernel killed while the preflight runs leaves nobody to delete it: its Job's TTL does
    (after its deadline, if its pod never ran), and the notebook pod's deletion too."""
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "jupyter-a", "uid": "u-1"}
    m = build("nbdist-ab12cd34", "team", "img", "10.0.0.5:4242", 2, 2, 1, {}, 0, {"pool": "a"},
              None, None, {}, owner, "python", 60, 600, True)
    check = m.preflight
    assert (check["kind"], check["metadata"]["name"]) == ("Job", "nbdist-ab12cd34-preflight")
    assert check["metadata"]["ownerReferences"] == [owner]
    spec = check["spec"]
    assert (spec["completions"], spec["backoffLimit"], spec["ttlSecondsAfterFinished"],
            spec["activeDeadlineSeconds"]) == (1, 0, 60, 600)
    assert spec["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "preflight"
    pod = spec["template"]["spec"]
    assert (pod["restartPolicy"], pod["nodeSelector"]) == ("Never", {"pool": "a"})
    assert pod["containers"][0]["command"][-2:] == ["10.0.0.5", "4242"]


def test_the_defaults_one_rank_per_pod_or_per_gpu():
    assert example(nodes=None, gpus=0).job["spec"]["completions"] == 4
    assert example(nodes=None, gpus=4).job["spec"]["completions"] == 1
    assert "owner" not in str(example().job["metadata"])  # outside a pod: no owner reference


@pytest.mark.parametrize("kw, error, match", [
    (dict(keep_alive="30m", active_deadline=1800), ValueError,
     r"active_deadline=1800 s ends the Job whatever happens, before keep_alive \(1800 s\) could "
     r"pass: pass an active_deadline longer than keep_alive"),
    (dict(keep_alive="soon"), ValueError, r"keep_alive must be a duration: seconds \(e.g. 1800\)"),
    (dict(active_deadline=0), ValueError, "active_deadline must be a positive int of seconds"),
    (dict(gpus=-1), ValueError, r"gpus must be an int >= 0 \(nvidia.com/gpu per pod\), got -1"),
    (dict(resources="2 cpus"), TypeError, "resources must be a dict, e.g. {'cpu': '4'"),
    (dict(tolerations={"key": "x"}), TypeError, "tolerations must be a list of dicts"),
    (dict(nodes=3), ValueError, "world_size=4 does not divide into nodes=3"),
    (dict(nodes=None, gpus=3), ValueError, "world_size=4 is not a multiple of gpus=3: without "
                                           "nodes= every pod runs one rank per GPU"),
    (dict(ttl=0), ValueError, "ttl must be a positive int of seconds, got 0"),
    (dict(python=""), ValueError, "python must be the interpreter's name or path in the image"),
    (dict(image=""), ValueError, "image must be a container image name, got ''"),
    (dict(listen="10.0.0.5"), ValueError, "listen must look like 'HOST:PORT'"),
])
def test_bad_options_are_refused_saying_what_was_expected(kw, error, match):
    with pytest.raises(error, match=match):
        example(**kw)
    with pytest.raises(error, match=match):  # the same from start(), before any cluster is asked
        nbdist.start(4, on="k8s", **dict(dict(image="i", namespace="n"), **kw))


def test_world_size_must_be_a_positive_int():
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        nbdist.k8s.manifests(0, image="i", namespace="n")


def test_without_image_and_namespace_the_cluster_is_needed(monkeypatch, tmp_path):
    pytest.importorskip("kubernetes", reason="kubernetes is not installed: without it the defaults "
                                             "are refused for that reason (the Windows suite)")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="manifests\\(\\) needs image= and namespace= here: no "
                                         "kubeconfig or in-cluster config"):
        nbdist.k8s.manifests(2)
    assert nbdist.engines.available_engines()["k8s"] == "no kubeconfig or in-cluster config"
    assert nbdist.engines.k8s.K8sEngine.ended({"namespace": "n", "job": "j"}) == \
        "Kubernetes is not reachable here: no kubeconfig or in-cluster config"
    with pytest.raises(ValueError, match="the engine 'k8s' cannot run here: no kubeconfig"):
        nbdist.start(2, on="k8s", image="i")


def test_without_the_client_the_engine_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "kubernetes", None)  # as if not installed
    assert k8s_api.missing() == "kubernetes is not installed (pip install 'nbdist[k8s]')"
    with pytest.raises(ValueError, match=r"cannot run here: kubernetes is not installed \(pip "):
        nbdist.start(2, on="k8s", image="i", namespace="n")
