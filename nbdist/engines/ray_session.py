"""This kernel's connection to Ray, shared by its Ray groups, and the cluster questions they ask.

:func:`connect` calls ``ray.init`` unless Ray is already initialised (by the user, or by another
group), and counts the groups that use the connection: the last one to let go disconnects -- and
so ends the Ray this kernel started (``address=None``) -- but never a connection the user made.
:class:`Session` places the placement group (a timeout says what was asked and what is free),
reads nodes and actors' deaths, and tears a group down in order. A ``keep_alive`` group's actors
and placement group are detached and named in :data:`NAMESPACE` (:func:`find` gets them back).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional

from ..errors import NbdistError

_lock = threading.Lock()
_users = 0  # groups using a connection nbdist made
_ours = False  # nbdist called ray.init (and so calls ray.shutdown after the last group)
_exit_hooked = False
NAMESPACE = "nbdist"  #: the Ray namespace of a keep_alive group's named, detached actors
#: what the Ray Client's error says when the cluster's client server could not start this kernel's
#: session: its proxier forks that server while gRPC threads run, and the child sometimes dies at
#: once (ray-project/ray#63202: about 1 connection in 14 there, 1 in 24 in this project's tests); a
#: second try starts a new one. Each entry: texts that all appear in the error -- Ray's own
#: message, or its proxier's traceback when the dead server was still a zombie as the proxier
#: looked at it (``start_specific_server`` raising ``psutil.ZombieProcess``; seen on a loaded
#: machine here). Other failures of that function (a runtime env, a log file) are not retried.
CLIENT_SERVER_RACE = (("Starting Ray client server failed",),
                      ("in start_specific_server", "ZombieProcess"))


def connect(address: Optional[str]) -> "Session":
    """Connect to Ray (``None``: start one here unless ``RAY_ADDRESS`` names a cluster;
    ``"auto"``: the cluster this machine is part of; ``"ray://HOST:PORT"``: the Ray Client)."""
    global _users, _ours, _exit_hooked
    import ray

    with _lock:
        if not _exit_hooked:
            # atexit runs the last registered first: Ray registered its shutdown when imported
            # (after nbdist): stop the groups before it, while Ray still answers
            import atexit

            from ..runtime.api import stop_all

            atexit.register(stop_all)
            _exit_hooked = True
        started_here = False
        if not ray.is_initialized():
            started_here = address is None and not os.environ.get("RAY_ADDRESS")
            try:
                _init(ray, address)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise NbdistError(f"could not connect to Ray at address={address!r}: {err}. "
                                  "Pass address='auto' on a node of a running cluster, "
                                  "'ray://HOST:10001' for the Ray Client, or None to start Ray "
                                  "here.") from None
            _ours, _users = True, 0
        if _ours:
            _users += 1
        return Session(started_here, _ours)


def _init(ray, address: Optional[str]) -> None:
    """``ray.init``; through the Ray Client, once more (saying so) if the cluster's client server
    failed to start this kernel's session (:data:`CLIENT_SERVER_RACE`)."""
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        return
    except (ConnectionError, RuntimeError) as err:
        if not str(address or "").startswith("ray://") or not any(
                all(text in str(err) for text in texts) for texts in CLIENT_SERVER_RACE):
            raise
    from ..runtime.current import say_once

    ray.shutdown()  # what the failed connection left
    say_once(f"nbdist: the Ray Client server at {address} failed to start this kernel's session "
             "(a known race in Ray: ray-project/ray#63202); trying once more.")
    ray.init(address=address, logging_level="WARNING", log_to_driver=False)


class Session:
    """One group's use of the connection."""

    def __init__(self, started_here: bool, counted: bool):
        self.started_here, self._counted = started_here, counted

    def notebook_host(self) -> str:
        """The address the Ray nodes reach this kernel at: loopback for a Ray it started, this
        machine's address for the Ray Client, else this node's address as Ray knows it."""
        import ray

        if self.started_here:
            return "127.0.0.1"
        if ray.util.client.ray.is_connected():
            from .slurm import default_host

            return default_host()
        return ray.util.get_node_ip_address()

    def place(self, world_size: int, bundle: Dict[str, float], strategy: str, timeout: float,
              name: str = ""):
        """A ready placement group of ``world_size`` bundles (``name``: a detached one of that
        name, which outlives this kernel); :class:`NbdistError` naming what was asked and what is
        free (the group removed) when Ray cannot place it in ``timeout`` s."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy,
                             name=name, lifetime="detached" if name else None)
        try:
            ray.get(pg.ready(), timeout=timeout)
        except BaseException as err:
            remove_placement_group(pg)
            if not isinstance(err, ray.exceptions.GetTimeoutError):
                raise
            alive = [n for n in ray.nodes() if n.get("Alive")]
            free = _resources(ray.available_resources())
            raise NbdistError(
                f"Ray could not place {world_size} bundles of {_resources(bundle)} ({strategy}) "
                f"within {timeout:g} s; the cluster has {len(alive)} node"
                f"{'s' if len(alive) != 1 else ''} and free {free or 'nothing'} (of "
                f"{_resources(ray.cluster_resources())}). Ask for fewer ranks or less per rank, "
                + ("or PACK/SPREAD (STRICT_SPREAD needs a node per rank), " if strategy ==
                   "STRICT_SPREAD" else "")
                + "or raise placement_timeout (a cluster that scales up needs the time to add "
                "nodes). The placement group was removed.") from None
        return pg

    def node(self, node_id: str) -> Optional[Dict[str, Any]]:
        """Ray's record of the node (``Alive``, ``DeathReasonMessage``...), ``None`` if unknown."""
        import ray

        for n in ray.nodes():
            if n.get("NodeID") == node_id:
                return n
        return None

    def actor_death(self, actor) -> str:
        """Why ``actor`` is dead (``""`` while it answers)."""
        import ray

        try:
            ray.get(actor.poll.remote(), timeout=5.0)
        except ray.exceptions.GetTimeoutError:
            return ""
        except Exception as err:  # noqa: BLE001 -- RayActorError, ActorDiedError...
            return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return ""

    def tear_down(self, actors: List[Any], pg) -> None:
        """In order, to the end: each worker's process group, each actor, the placement group;
        then let go of the connection."""
        import ray

        try:
            if ray.is_initialized():
                stops = [a.stop.remote() for a in actors]
                for ref in stops:
                    try:
                        ray.get(ref, timeout=15.0)
                    except Exception:  # noqa: BLE001 -- a dead actor: its worker died with it
                        pass
                for a in actors:
                    try:
                        ray.kill(a, no_restart=True)
                    except Exception:  # noqa: BLE001 -- already gone
                        pass
                if pg is not None:
                    from ray.util.placement_group import remove_placement_group

                    try:
                        remove_placement_group(pg)
                    except Exception:  # noqa: BLE001 -- already removed
                        pass
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the connection (once): the last group of a connection nbdist made ends it."""
        global _users, _ours
        import ray

        with _lock:
            if self._counted and _ours:
                _users -= 1
                if _users <= 0:
                    _ours, _users = False, 0
                    ray.shutdown()
            self._counted = False


def find(names: List[str], pg_hex: str):
    """``(actors, placement group)`` of a keep_alive group by its actors' names: ``None`` for an
    actor that is gone; the placement group ``None`` when Ray has removed it."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table

    actors: List[Any] = []
    for name in names:
        try:
            actors.append(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:  # no live actor of that name
            actors.append(None)
    pg = PlacementGroup(PlacementGroupID.from_hex(pg_hex))
    state = placement_group_table(pg).get("state")
    return actors, (pg if state not in (None, "REMOVED") else None)


def _resources(res: Dict[str, float]) -> str:
    """``"CPU 2, GPU 1, memory 4.0 GiB"``: Ray's resources, less the per-node ``node:...``."""
    parts = []
    res = dict({"CPU": 0.0}, **res)  # Ray leaves out what is all used: say "CPU 0"
    for k in sorted(res, key=lambda k: (k not in ("CPU", "GPU"), k)):
        if k.startswith(("node:", "accelerator_type", "bundle_group_")) or "_group_" in k:
            continue  # a node's own marker, or what placement groups hold
        v = res[k]
        if k in ("memory", "object_store_memory"):
            parts.append(f"{k} {v / 2 ** 30:.1f} GiB")
        else:
            parts.append(f"{k} {v:g}")
    return ", ".join(parts)
