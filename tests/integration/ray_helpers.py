"""A real two-node Ray cluster on this machine for tests/integration/test_engine_ray.py:
``ray.cluster_utils.Cluster`` with a head and a second node, one CPU each, small object stores;
the head serves the Ray Client (``ray://127.0.0.1:<client_port>``).

Both nodes share this machine's address, so ranks are told apart by Ray node id. The cluster's
processes are this test process's children; :meth:`LocalRay.stop` ends them all and checks that
none is left (the suite's leak check is off for the module: Ray starts and ends worker processes
of its own between tests)."""
import os
import time
from pathlib import Path

import psutil

from attach_helpers import free_port

#: first on the cluster's PYTHONPATH: see ray_quick_imports/rfc3987_syntax/__init__.py
QUICK_IMPORTS = str(Path(__file__).parent / "ray_quick_imports")
REPO = str(Path(__file__).parents[2])
STORE = 80 * 1024 ** 2  #: bytes of object store per node


def cluster_env() -> dict:
    """The environment the cluster's processes (and a kernel's) need: nbdist importable, the
    quick import of jsonschema's IRI parser."""
    paths = [QUICK_IMPORTS, REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                     if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


class LocalRay:
    """Head + one more node (``self.second``); the test process connected as the driver."""

    def __init__(self):
        import ray
        from ray.cluster_utils import Cluster

        self._saved = {k: os.environ.get(k) for k in cluster_env()}
        os.environ.update(cluster_env())
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        self.cluster = None
        try:
            self.client_port = free_port()  # the head serves the Ray Client there
            self.cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 1, "object_store_memory": STORE,
                "ray_client_server_port": self.client_port})
            self.second = self.cluster.add_node(num_cpus=1, object_store_memory=STORE)
            self.address = self.cluster.address
            ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
            self.cluster.wait_for_nodes()
        except BaseException:
            self.stop(before)
            raise
        self.before = before

    def stop(self, before=None) -> None:
        """Disconnect, end every node, and make sure none of their processes is left."""
        import ray

        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        before = (self.before if before is None else before) | _helpers()
        deadline = time.monotonic() + 30.0
        while True:
            left = {p.pid: _cmd(p) for p in psutil.Process().children(recursive=True)
                    if p.pid not in before and _alive(p)}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        assert not left, f"Ray left processes behind: {left}"


def _helpers() -> set:
    """multiprocessing's forkserver and resource tracker and nbdist's warm spares (a test may
    start them; the suite's leak check does not count them either)."""
    import multiprocessing.forkserver as mp_forkserver
    import multiprocessing.resource_tracker as mp_tracker

    from nbdist.runtime import spares

    server = getattr(mp_forkserver, "_forkserver", None)
    tracker = getattr(mp_tracker, "_resource_tracker", None)
    return {getattr(server, "_forkserver_pid", None), getattr(tracker, "_pid", None),
            *spares.pids()}


def _alive(p) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cmd(p) -> str:
    try:
        return " ".join(p.cmdline())[:120] or p.name()
    except psutil.Error as err:
        return f"({type(err).__name__})"


def workers() -> set:
    """The pids of nbdist workers among this process's descendants (ranks in Ray's actors)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "nbdist.worker" in " ".join(p.cmdline()) and _alive(p):
                out.add(p.pid)
        except psutil.Error:
            pass
    return out


def live(job_id: str):
    """The actors still alive and the placement groups not removed of Ray job ``job_id``, read
    with Ray's state API."""
    from ray.util.state import list_actors, list_placement_groups

    actors = [a.actor_id for a in list_actors(filters=[("job_id", "=", job_id)], limit=1000)
              if a.state != "DEAD"]
    groups = [g.placement_group_id for g in list_placement_groups(detail=True, limit=1000)
              if g.creator_job_id == job_id and g.state != "REMOVED"]
    return actors, groups
