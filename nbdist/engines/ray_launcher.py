"""The launch of a Ray group: connect, place, preflight, start the ranks in actors, tear down.

:class:`RayLauncher` is an :class:`~nbdist.runtime.attach.AttachLauncher` that starts the ranks
itself: once the listener and the key are ready it asks Ray for one placement group of
``world_size`` bundles (a timeout names what was asked and what is free, and removes the group),
puts one actor (:class:`~.ray_actor.RankHost`, ``max_restarts=0``) on each bundle, has each dial the
notebook (the preflight), then starts ``python -m nbdist.worker --connect`` in each. While the ranks
join, ``nbdist-ray-watch`` polls the actors and wakes the admission when a worker exits or an actor
dies first. Teardown, in order and to the end: kill each worker's process group, ``ray.kill`` each
actor, remove the placement group -- then disconnect from Ray if this launcher connected.

A SIGKILLed kernel leaves nothing either: the actors and the placement group are the driver's
(not detached), and Ray removes them when its driver goes; a Ray the kernel started goes with it.
With ``keep_alive`` they are detached instead, named after the job (``nbdist-JOB``,
``nbdist-JOB-rank-I`` in the namespace ``nbdist``), so that a new kernel finds them
(:meth:`RayLauncher.reattach`); once keep_alive passes with no kernel, the ranks exit and the actors
remove themselves and the placement group (:meth:`~.ray_actor.RankHost.keep`).
"""
from __future__ import annotations

import secrets
import socket
import threading
from typing import Any, Dict, List, Optional

from ..errors import NbdistError, ranks_phrase
from ..runtime.attach import AttachLauncher
from ..runtime.ready import AdmissionStopped
from . import ray_session
from .admission import EngineAdmission, EngineProcess
from .ray_actor import RankHost, rank_layout

REFUSAL = ("the ranks of a Ray group run in its actors; nbdist does not restart them. Call stop() "
           "and nbdist.start(..., on='ray') again.")
CAUSES = ("The usual causes: the notebook runs outside the cluster's network (the Ray Client, "
          "address='ray://...': run the notebook on a node of the cluster, or pass "
          "listen='HOST:PORT' with an address the nodes reach); on KubeRay, a NetworkPolicy that "
          "keeps the Ray pods from connecting to the notebook's pod (allow it); a firewall on "
          "this machine.")
KEEP_REFUSAL = ("keep_alive on Ray needs a running Ray cluster: with address=None this kernel "
                "starts Ray itself, and that Ray (with the ranks' actors) ends with the kernel. "
                "Start a cluster (ray start --head) and pass address='auto' (or its address).")


class RayLauncher(AttachLauncher):
    """One placement group, one actor per rank, each actor running one worker."""

    broken_advice = "stop() it and start a new one with nbdist.start(..., on='ray')."

    def __init__(self, bundle: Dict[str, float], placement: str, address: Optional[str],
                 runtime_env: Optional[Dict[str, Any]], listen, python: Optional[str],
                 placement_timeout: float, join_timeout: float, progress: bool,
                 protect: Optional[bool]):
        super().__init__(listen or ("127.0.0.1", 0), None, join_timeout, None, progress, protect)
        self.listen_given, self._protect_arg = listen is not None, protect
        self.bundle, self.placement, self.ray_address = bundle, placement, address
        self.runtime_env, self.python = runtime_env, python
        self.placement_timeout = placement_timeout
        self.pg = None
        self.actors: List[Any] = []
        self.places: List[Dict[str, Any]] = []  #: per rank: node index, Ray node id, host
        self._session: Optional[ray_session.Session] = None
        self._watch: Optional[_Watch] = None
        self.job = ""  #: a keep_alive group's name: its placement group's, its actors' prefix
        self.names: List[str] = []  #: a keep_alive group's actor names, in bundle order

    @classmethod
    def reattach(cls, handle: Dict[str, Any], join_timeout: float,
                 progress: bool) -> "RayLauncher":
        """A launcher that takes back the ranks of a keep_alive group's ``handle`` (its named
        actors and placement group, found again once connected)."""
        launcher = cls({}, handle.get("placement", "PACK"), handle.get("ray_address"), None,
                       tuple(handle["address"]), None, 60.0, join_timeout, progress,
                       bool(handle.get("protect")))
        launcher.job, launcher.names = handle["job"], list(handle["actors"])
        launcher.pg_hex, launcher.places = handle["pg"], list(handle["places"])
        return launcher

    @property
    def restart_refusal(self) -> Optional[str]:
        """Always: start a new group instead."""
        return REFUSAL

    def can_relaunch(self, auto_restart: bool) -> bool:
        """Never: new actors are a new group."""
        return False

    def launch(self, group_id, choice, opts, threads, tmp, relay):
        """Connect to Ray, then listen, place, preflight and start the ranks; ranks ready, or raise
        with everything removed."""
        if self.regen is not None:
            return super().launch(group_id, choice, opts, threads, tmp, relay)
        if self.keep_alive and self.ray_address is None:
            self.close()
            raise ValueError(KEEP_REFUSAL)
        try:
            self._session = ray_session.connect(self.ray_address)
            if not self.listen_given:
                self.address = (self._session.notebook_host(), 0)
                if self._protect_arg is None:
                    from ..runtime.attach import is_loopback

                    self.protect = not is_loopback(self.address[0])
            return super().launch(group_id, choice, opts, threads, tmp, relay)
        except AdmissionStopped:
            why = self._watch.ended if self._watch is not None else "the group was stopped"
            self.close()
            raise NbdistError(f"a rank of the Ray group ended before it joined: {why}") from None
        except BaseException:
            self.close()
            raise
        finally:
            if self._watch is not None:
                self._watch.close()
                self._watch = None

    def listening(self, host, port, world_size):
        """Place the bundles, start an actor on each, preflight, start the workers."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.reattach_key:
            return self._find(host, port, world_size)
        if self.keep_alive:
            self.job = f"nbdist-{secrets.token_hex(4)}"
            self.names = [f"{self.job}-rank-{i}" for i in range(world_size)]
        self.pg = self._session.place(world_size, self.bundle, self.placement,
                                      self.placement_timeout, self.job)
        cls = ray.remote(RankHost)
        cpus, gpus = self.bundle.get("CPU", 0), self.bundle.get("GPU", 0)
        others = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        try:
            for i in range(world_size):
                opts = dict(num_cpus=cpus, num_gpus=gpus, resources=others or None,
                            max_restarts=0, max_task_retries=0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                self.pg, placement_group_bundle_index=i))
                if self.runtime_env:
                    opts["runtime_env"] = self.runtime_env
                if self.keep_alive:  # outlive this kernel; found again by name
                    opts.update(name=self.names[i], namespace=ray_session.NAMESPACE,
                                lifetime="detached")
                self.actors.append(cls.options(**opts).remote())
            places = ray.get([a.where.remote() for a in self.actors], timeout=self.join_timeout)
        except Exception as err:  # noqa: BLE001 -- Ray's many errors of an actor not starting
            raise NbdistError(
                f"the Ray actors of the ranks did not start: {type(err).__name__}: {err}\n"
                "nbdist (this version, with torch) must be importable on the Ray nodes: install it "
                "in their environment, or pass runtime_env= (e.g. {'pip': [...]} or "
                "{'py_modules': [...]}).") from None
        layout = rank_layout(places)
        self.places = [dict(p, **lay) for p, lay in zip(places, layout)]
        self._preflight(host, port)
        with open(self.key_file, encoding="ascii") as f:
            key_hex = f.read().strip()
        ray.get([a.start.remote(f"{host}:{port}", key_hex, lay["env"], self.python)
                 for a, lay in zip(self.actors, layout)], timeout=60.0)
        if self.keep_alive:
            ray.get([a.keep.remote([n for n in self.names if n != mine], ray_session.NAMESPACE,
                                   self.pg.id.hex())
                     for a, mine in zip(self.actors, self.names)], timeout=60.0)
        if self.progress:
            nodes = len({p["node_id"] for p in self.places})
            print(f"nbdist: {world_size} ranks started in Ray actors on {nodes} node"
                  f"{'s' if nodes > 1 else ''} ({self.placement}); they connect to {host}:{port}.")
        self._watch = _Watch(self)

    def _find(self, host: str, port: int, world_size: int) -> None:
        """Reattaching: the keep_alive group's actors and placement group, by name."""
        actors, self.pg = ray_session.find(self.names, self.pg_hex)
        self.actors = [a for a in actors if a is not None]
        if len(self.actors) != len(self.names) or self.pg is None:
            raise NbdistError(f"reattach: the Ray group {self.job} is incomplete ("
                              f"{len(self.actors)} of {len(self.names)} actors left"
                              f"{'' if self.pg is not None else ', no placement group'}).")
        if self.progress:
            print(f"nbdist: reattaching to Ray group {self.job}: its {world_size} ranks connect "
                  f"to {host}:{port}.")

    def handle_fields(self) -> Dict[str, Any]:
        """The names of the actors and the placement group, Ray's address, the ranks' places."""
        return {"job": self.job, "actors": self.names, "pg": self.pg.id.hex(),
                "ray_address": self.ray_address, "placement": self.placement,
                "places": self.places}

    def _preflight(self, host: str, port: int) -> None:
        """Every actor dials the listener before any rank starts."""
        import ray

        said = ray.get([a.dial.remote(host, port, 10.0) for a in self.actors], timeout=60.0)
        bad = [(p, why) for p, why in zip(self.places, said) if why]
        if bad:
            lines = "; ".join(f"rank {p['rank']} on Ray node {p['node_id'][:8]} ({p['ip']}): "
                              f"{why}" for p, why in sorted(bad, key=lambda b: b[0]["rank"]))
            raise NbdistError(f"the Ray actors cannot connect to this notebook at {host}:{port} "
                              f"(blocked: {lines}). {CAUSES}")

    def _admission(self, ws, config, relay, progress):
        admission = _RayAdmission(ws, config, relay, False)
        admission.protect, admission.launcher = self.protect, self
        if self._watch is not None:
            admission.wake = self._watch.wake
        return admission

    def place_of(self, rank: int) -> Optional[Dict[str, Any]]:
        """Where Ray put ``rank`` (``None`` if unknown)."""
        for p in self.places:
            if p["rank"] == rank:
                return p
        return None

    def death_note(self, rank: int) -> str:
        """What Ray says about the lost ``rank``'s node and actor (``""``: nothing unusual)."""
        place = self.place_of(rank)
        if place is None or self._session is None:
            return ""
        parts = []
        node = self._session.node(place["node_id"])
        if node is not None and not node.get("Alive", True):
            why = node.get("DeathReasonMessage") or ""
            on = [p["rank"] for p in self.places if p["node_id"] == place["node_id"]]
            parts.append(f"Ray says node {place['node_id'][:8]} ({ranks_phrase(on)}) is dead"
                         + (f": {why}" if why else ""))
        actor_said = self._session.actor_death(self.actors[self.places.index(place)])
        if actor_said:
            parts.append(f"its actor is dead: {actor_said}")
        return "; ".join(parts)

    def close(self, deadline=None) -> None:
        """Kill the workers' process groups, the actors, the placement group (in that order, to
        the end, once), then let go of Ray; see :meth:`AttachLauncher.close` for ``deadline``."""
        letting_go = self.letting_go  # a reattach that failed: the ranks wait on
        super().close(deadline)
        actors, self.actors = self.actors, []
        pg, self.pg = self.pg, None
        session, self._session = self._session, None
        if session is not None:
            if letting_go:
                session.release()
            else:
                session.tear_down(actors, pg)


class RayProcess(EngineProcess):
    """A rank in a Ray actor: placed by its Ray node, and lost with what Ray says."""

    launcher: RayLauncher
    lost_advice = ("nbdist does not restart the ranks of a Ray group: call stop(), then "
                   "nbdist.start(..., on='ray') again")

    @property
    def where(self) -> str:
        """``"node 1: Ray node 3f2a9c01, host gpu7"``."""
        place = self.launcher.place_of(self.rank)
        if place is None:
            return super().where
        return f"node {place['node']}: Ray node {place['node_id'][:8]}, host {self.host}"

    def engine_note(self) -> str:
        """Ray's word on the rank's node and actor."""
        try:
            return self.launcher.death_note(self.rank)
        except Exception:  # noqa: BLE001 -- Ray unreachable: the loss is still reported
            return ""


class _RayAdmission(EngineAdmission):
    """Ranks of the Ray group: their processes know their Ray node."""

    process_class = RayProcess
    launcher: RayLauncher

    def timed_out(self, missing, ranks, timeout):
        return (f"{ranks_phrase(missing)} did not join within {timeout:.0f} s; {len(ranks)} of "
                f"{self.world_size} connected (their Ray actors run; see the Ray dashboard's "
                "logs of those actors).")


class _Watch:
    """``nbdist-ray-watch``: while the ranks join, poll the actors twice a second; :attr:`wake`
    turns readable (and :attr:`ended` says why) when a worker exits or an actor dies first."""

    PERIOD = 0.5

    def __init__(self, launcher: RayLauncher):
        self.actors, self.places = list(launcher.actors), list(launcher.places)
        self.ended: Optional[str] = None
        self.wake, self._poke = socket.socketpair()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbdist-ray-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._done.wait(self.PERIOD):
            for actor, place in zip(self.actors, self.places):
                where = f"rank {place['rank']} (Ray node {place['node_id'][:8]})"
                try:
                    said = ray.get(actor.poll.remote(), timeout=10.0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception as err:  # noqa: BLE001 -- the actor died (RayActorError...)
                    self._end(f"the actor of {where} died: {type(err).__name__}: {err}")
                    return
                if said is not None:
                    code, tail = said
                    self._end(f"the worker of {where} exited with code {code}"
                              + (f"; its stderr ends with:\n{tail}" if tail else ""))
                    return

    def _end(self, why: str) -> None:
        self.ended = why
        try:
            self._poke.send(b"!")
        except OSError:
            pass

    def close(self) -> None:
        self._done.set()
        self._thread.join(15.0)
        self.wake.close()
        self._poke.close()
