"""What runs inside a Ray group's actors, and where each rank goes.

:class:`RankHost` is the body of one actor per placement-group bundle (made a Ray actor class by
:mod:`.ray_launcher`, so this module imports no Ray at import): it says where Ray put it (node id,
GPU ids), dials the notebook before the group starts (the preflight), then starts
``python -m nbdist.worker --connect`` as its child -- in a process group of its own, with a
parent-death signal, so a killed actor takes its rank with it -- and kills that process group at
teardown. In a ``keep_alive`` group (detached actors, which no kernel's exit removes),
:meth:`RankHost.keep` has each actor remove itself once its worker exits (its keep_alive passed
with no kernel, or it died), and the last of them the placement group: nothing is left.
:func:`rank_layout` orders the ranks (by Ray node id, then GPU id) and gives each the
variables torchrun would.

Runs on the Ray nodes: imports only the standard library and :mod:`nbdist.engines`' package (no
runtime, no torch) until a worker is started.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

STDERR_TAIL = 1500  #: characters of a worker's stderr kept for an error message


def _die_with_parent() -> None:  # pragma: no cover -- runs in the child between fork and exec
    """Linux: SIGKILL this process when the actor that started it dies (PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


class RankHost:
    """One actor of a Ray group: it hosts one rank's worker process."""

    def __init__(self) -> None:
        self.child: Optional[subprocess.Popen] = None
        self.dir: Optional[str] = None
        self._stopping = False  # stop() was called: the kernel tears the group down

    def where(self) -> Dict[str, Any]:
        """Ray's node id, the GPU ids Ray gave this actor, the host name and address, the pid."""
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "gpus": [str(g) for g in ray.get_gpu_ids()],
                "host": socket.gethostname(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def dial(self, host: str, port: int, timeout: float) -> Optional[str]:
        """Connect to the notebook's listener and hang up: ``None``, or why it failed."""
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as err:
            return f"{type(err).__name__}: {err}"
        return None

    def start(self, address: str, key_hex: str, env: Dict[str, str],
              python: Optional[str] = None) -> int:
        """Start the rank's worker (``python -m nbdist.worker --connect address``): the key in a
        private file of this node's, ``env`` over the actor's environment; return its pid."""
        self.dir = tempfile.mkdtemp(prefix="nbdist-ray-")
        key_file = os.path.join(self.dir, "key.hex")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key_hex)
        child_env = dict(os.environ)
        # the directory nbdist is imported from here (nbdist/engines/ray_actor.py: three up)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (here, child_env.get("PYTHONPATH", "")) if p)
        child_env.update(env)
        err = open(os.path.join(self.dir, "stderr"), "wb")
        try:
            self.child = subprocess.Popen(
                [python or sys.executable, "-m", "nbdist.worker", "--connect", address,
                 "--key-file", key_file], env=child_env, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        finally:
            err.close()
        return self.child.pid

    def poll(self) -> Optional[List[Any]]:
        """``None`` while the worker runs, else ``[exit code, the end of its stderr]``."""
        if self.child is None or self.child.poll() is None:
            return None
        return [self.child.returncode, self._stderr_tail()]

    def _stderr_tail(self) -> str:
        try:
            with open(os.path.join(self.dir or "", "stderr"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - STDERR_TAIL))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def keep(self, peers: List[str], namespace: str, pg_hex: str) -> None:
        """A keep_alive group's actor (detached): once the worker exits by itself, remove this
        actor -- and, when every peer's worker has exited too (or its actor is gone), first the
        placement group ``pg_hex``, which takes what is left of the group with it."""
        threading.Thread(target=self._reap, args=(self.child, peers, namespace, pg_hex),
                         name="nbdist-ray-reap", daemon=True).start()

    def _reap(self, child, peers, namespace, pg_hex) -> None:  # pragma: no cover -- in an actor
        import ray

        while child.poll() is None:
            time.sleep(0.5)
        if self._stopping:
            return  # the kernel's stop(): it kills the actors and removes the placement group
        last = True
        for name in peers:  # race-free: each looks after its own worker exited
            try:
                said = ray.get(ray.get_actor(name, namespace=namespace).poll.remote(), timeout=30)
            except ValueError:  # gone already
                continue
            except ray.exceptions.GetTimeoutError:
                last = False
                break
            except Exception:  # noqa: BLE001 -- its actor died
                continue
            if said is None:
                last = False
                break
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        try:
            if last:
                from ray._raylet import PlacementGroupID
                from ray.util.placement_group import PlacementGroup, remove_placement_group

                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_hex)))
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        finally:
            os._exit(0)

    def stop(self) -> None:
        """Kill the worker's process group (the worker and anything it started), remove the key."""
        self._stopping = True
        child, self.child = self.child, None
        if child is not None:
            try:
                if hasattr(os, "killpg"):
                    os.killpg(child.pid, signal.SIGKILL)
                else:  # Windows: no process groups
                    child.kill()
            except (ProcessLookupError, PermissionError):
                pass
            try:
                child.wait(10.0)
            except subprocess.TimeoutExpired:
                pass
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def rank_layout(places: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """For the actors in bundle order (each ``where()``'s answer), the ranks' placement: one dict
    per actor, in bundle order, with ``rank``, ``node`` (the node's index) and ``env``.

    Ranks are ordered by Ray node id (not by address: nodes may share one), then by GPU id, then
    by bundle; ``NBDIST_RAY_NODE_ID`` is the rank's Ray node; ``CUDA_VISIBLE_DEVICES`` is every GPU the node's actors were given, so each rank
    sees its node's peers (as Ray Train does) and ``LOCAL_RANK`` indexes its own GPU among them.
    """
    def gpu_key(p):
        return [int(g) if g.isdigit() else g for g in p["gpus"]]

    order = sorted(range(len(places)),
                   key=lambda i: (places[i]["node_id"], gpu_key(places[i]), i))
    nodes: List[str] = []
    for i in order:
        if places[i]["node_id"] not in nodes:
            nodes.append(places[i]["node_id"])
    out: List[Dict[str, Any]] = [{} for _ in places]
    world = len(places)
    for rank, i in enumerate(order):
        node_id = places[i]["node_id"]
        mine = [j for j in order if places[j]["node_id"] == node_id]
        gpus = sorted({g for j in mine for g in places[j]["gpus"]},
                      key=lambda g: (0, int(g)) if g.isdigit() else (1, g))
        env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": mine.index(i),
               "LOCAL_WORLD_SIZE": len(mine), "GROUP_RANK": nodes.index(node_id),
               "GROUP_WORLD_SIZE": len(nodes), "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world,
               "CUDA_VISIBLE_DEVICES": ",".join(gpus), "NBDIST_RAY_NODE_ID": node_id}
        out[i] = {"rank": rank, "node": nodes.index(node_id), "node_id": node_id,
                  "env": {k: str(v) for k, v in env.items()}}
    return out
