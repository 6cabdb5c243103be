"""``on="ray"`` before Ray is asked anything: the options refused, the ranks' order and variables,
and Ray missing. No Ray is started here (tests/integration/test_engine_ray.py starts one)."""
import importlib.util
import sys

import pytest

import nbdist
from nbdist.engines.ray import PLACEMENTS, RayEngine, bundle_of
from nbdist.engines.ray_actor import rank_layout
from nbdist.runtime.engines import engines_here


@pytest.mark.parametrize("options, error, message", [
    (dict(placement="TIGHT"), ValueError,
     "placement must be one of PACK, SPREAD, STRICT_SPREAD, STRICT_PACK, got 'TIGHT'"),
    (dict(num_cpus=-1), ValueError, r"num_cpus must be a number >= 0 \(Ray's units per rank\)"),
    (dict(num_gpus="1"), ValueError, "num_gpus must be a number >= 0"),
    (dict(num_cpus=0), ValueError, "Ray cannot place an empty bundle. Pass num_cpus=1"),
    (dict(resources=["TPU"]), TypeError, "resources must be a dict of Ray's custom resources"),
    (dict(resources={"GPU": 1}), ValueError, r"resources=\{'GPU': ...\}: pass num_gpus= instead"),
    (dict(resources={"TPU": -2}), ValueError, r"resources\['TPU'\] must be a number >= 0"),
    (dict(address=10001), TypeError, "address must be None .*, 'auto' or 'ray://HOST:PORT'"),
    (dict(runtime_env="env.yaml"), TypeError, "runtime_env must be a dict"),
    (dict(placement_timeout=0), ValueError, "placement_timeout must be a positive number"),
    (dict(listen="0.0.0.0:0"), ValueError, "listen on one address you chose"),
    pytest.param(
        dict(keep_alive="30m"), ValueError,
        r"keep_alive on Ray needs a running Ray cluster: with address=None this kernel starts Ray "
        r"itself, and that Ray \(with the ranks' actors\) ends with the kernel\. Start a cluster "
        r"\(ray start --head\) and pass address='auto' \(or its address\)\.",
        marks=pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="Ray is not installed: the engine is refused as unusable "
                                        "first (the Windows suite)")),
])
def test_bad_options_are_refused_before_ray_is_asked(options, error, message):
    ray_before = sys.modules.get("ray")
    with pytest.raises(error, match=message):
        nbdist.start(2, on="ray", **options)
    if ray_before is None and "ray" in sys.modules:  # imported, never started
        assert not sys.modules["ray"].is_initialized()


def test_the_ray_module_and_its_bundle():
    assert nbdist.ray.start is nbdist.engines.ray.start and PLACEMENTS[0] == "PACK"
    assert bundle_of(1, 0.5, {"TPU": 1, "spare": 0}) == {"CPU": 1.0, "GPU": 0.5, "TPU": 1.0}
    assert RayEngine.name == "ray" and "keep_alive" not in RayEngine.options


def test_without_ray_the_engine_says_it_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    assert engines_here()["ray"] == "ray is not installed (pip install 'nbdist[ray]')"
    with pytest.raises(ValueError, match=r"the engine 'ray' cannot run here: ray is not "
                                         r"installed \(pip install 'nbdist\[ray\]'\)"):
        nbdist.ray.start(2)


def place(node, *gpus):
    return {"node_id": node, "gpus": list(gpus), "host": "h", "ip": "10.0.0.1", "pid": 1}


def test_ranks_are_ordered_by_node_id_then_gpu_with_torchruns_variables():
    # bundle order as Ray might return it: nodes interleaved, GPUs out of order
    places = [place("bb", "3"), place("aa", "1"), place("bb", "2"), place("aa", "0")]
    out = rank_layout(places)
    assert [o["rank"] for o in out] == [3, 1, 2, 0]
    assert [o["node"] for o in out] == [1, 0, 1, 0]
    envs = {o["rank"]: o["env"] for o in out}
    assert envs[0] == {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "0",
                       "ROLE_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1",
                       "NBDIST_RAY_NODE_ID": "aa"}
    assert (envs[3]["LOCAL_RANK"], envs[3]["GROUP_RANK"], envs[3]["CUDA_VISIBLE_DEVICES"]) == \
        ("1", "1", "2,3")
    # GPU ids compare as numbers (10 after 9), and CPU ranks see no GPU
    assert [o["rank"] for o in rank_layout([place("n", "10"), place("n", "9")])] == [1, 0]
    cpu = rank_layout([place("n"), place("n")])
    assert [o["env"]["CUDA_VISIBLE_DEVICES"] for o in cpu] == ["", ""]
    assert [o["rank"] for o in cpu] == [0, 1]  # same node, no GPU: bundle order


class _FlakyRay:
    """Ray's ``init``/``shutdown`` as the Ray Client answers when the cluster's client server
    failed to start the session (ray-project/ray#63202) ``fails`` times: the error text is Ray's."""

    def __init__(self, fails: int, text: str = "Starting Ray client server failed. See "
                                                "ray_client_server_23001.err for detailed logs."):
        self.fails, self.text, self.calls = fails, text, []

    def init(self, address, **_):
        self.calls.append(("init", address))
        if self.fails:
            self.fails -= 1
            raise ConnectionAbortedError(f"Initialization failure from server:\n{self.text}")

    def shutdown(self):
        self.calls.append(("shutdown",))


_ZOMBIE = ("Traceback (most recent call last):\n  File \".../ray/util/client/server/proxier.py\", "
           "line 396, in start_specific_server\n    cmd = psutil_proc.cmdline()\n"
           "psutil.ZombieProcess: PID still exists but it's a zombie (pid=12371)")


@pytest.mark.parametrize("text", [None, _ZOMBIE], ids=["server-failed", "server-a-zombie"])
def test_the_ray_clients_server_race_is_tried_once_more_and_said(monkeypatch, caplog, text):
    import logging

    from nbdist.engines import ray_session
    from nbdist.runtime import current

    monkeypatch.setattr(current, "_notes_said", set())
    caplog.set_level(logging.INFO, logger="nbdist")  # outside a kernel a note is a log record
    ray = _FlakyRay(fails=1) if text is None else _FlakyRay(fails=1, text=text)
    ray_session._init(ray, "ray://head:10001")
    assert ray.calls == [("init", "ray://head:10001"), ("shutdown",), ("init", "ray://head:10001")]
    assert ("nbdist: the Ray Client server at ray://head:10001 failed to start this kernel's "
            "session (a known race in Ray: ray-project/ray#63202); trying once more.") in caplog.text
    with pytest.raises(ConnectionAbortedError, match="Starting Ray client server failed"):
        ray_session._init(_FlakyRay(fails=2), "ray://head:10001")  # once more, not forever


@pytest.mark.parametrize("address, text", [
    ("auto", "Starting Ray client server failed."),  # not the Ray Client: nothing to start again
    ("ray://head:10001", "Connection refused"),  # another failure: said as it is
    # the same function failing otherwise (its runtime env, say): not the race
    ("ray://head:10001", 'File ".../proxier.py", line 380, in start_specific_server\n'
                         "RuntimeError: Failed to create runtime env"),
])
def test_other_ray_connection_failures_are_not_tried_again(address, text):
    from nbdist.engines import ray_session

    ray = _FlakyRay(fails=1, text=text)
    with pytest.raises(ConnectionAbortedError):
        ray_session._init(ray, address)
    assert ray.calls == [("init", address)]
