"""The launch of a Kubernetes group: listen, preflight, create the objects, show the wait, admit.

:class:`K8sLauncher` is an :class:`~nbdist.runtime.attach.AttachLauncher` that starts the ranks
itself. Once the listener and the key are ready it runs the preflight Job (one pod: a TCP
connection from where the ranks will run back to the notebook) and waits for it with its state
shown; then it
creates the Job suspended, the key's Secret and the headless Service (both owned by the Job), and
resumes the Job. The ``nbdist-k8s-wait`` thread reads the pods once a second and shows them
(Pending with the scheduler's reason, ImagePullBackOff...); a pod or the Job that fails before the
ranks joined wakes the admission with Kubernetes' reason and the pod's last lines. Ctrl-C,
``stop()`` and the kernel's exit delete everything created (foreground propagation) -- except
at the exit of a kernel whose group has ``keep_alive``: its Job waits for ``nbdist.reattach()``,
whose launcher (:meth:`K8sEngine.reattach <nbdist.engines.k8s.K8sEngine.reattach>`) deletes it
all when stopped.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

from ..errors import NbdistError
from ..runtime.attach import AttachLauncher
from ..runtime.ready import AdmissionStopped
from ..wire.deadline import WAKE_S, Deadline, poll_until
from . import k8s_api
from .admission import EngineAdmission, EngineProcess
from .k8s_manifests import Manifests, selector

REFUSAL = ("the ranks of a Kubernetes group run in its Job; nbdist does not restart them. Call "
           "stop() and nbdist.start(..., on='k8s') again (a new Job).")
#: what usually stops a pod from reaching the notebook, and the Helm values that open the way
CAUSES = (
    "Usual causes: a NetworkPolicy that admits into the notebook pod only the hub and the proxy -- "
    "Zero to JupyterHub's chart does so by default: set singleuser.networkPolicy.ingress to admit "
    "pods labelled app.kubernetes.io/name=nbdist (or singleuser.networkPolicy.enabled=false); an "
    "egress policy on the ranks' namespace; an Istio sidecar in the notebook pod (annotate it "
    "traffic.sidecar.istio.io/excludeInboundPorts with the port, pass listen='IP:PORT' to fix "
    "it, or set sidecar.istio.io/inject: \"false\" in singleuser.extraAnnotations). See "
    "docs/multinode.md, \"Kubernetes\".")


class K8sLauncher(AttachLauncher):
    """Creates one Indexed Job whose pods run every rank, then admits them as attached ranks."""

    broken_advice = "stop() it and start a new one with nbdist.start(..., on='k8s') (a new Job)."

    def __init__(self, plan: Callable[..., Manifests], api: "k8s_api.Api", address,
                 per_node: int, join_timeout: float, progress: bool, protect: Optional[bool],
                 keep_alive=None):
        super().__init__(address, None, join_timeout, per_node, progress, protect)
        self.plan, self.api, self.keep_alive = plan, api, keep_alive
        self.manifests: Optional[Manifests] = None
        self.created: List[tuple] = []  #: (kind, namespace, name) of everything created
        self.pods: Dict[str, str] = {}  #: pod index -> pod name, once joined
        self._wait: Optional[_Wait] = None

    @property
    def restart_refusal(self) -> Optional[str]:
        """Always: a Kubernetes group's ranks are not restarted (start a new Job instead)."""
        return REFUSAL

    def can_relaunch(self, auto_restart: bool) -> bool:
        """Never: a new Job is a new group."""
        return False

    def launch(self, group_id, choice, opts, threads, tmp, relay):
        """Listen, preflight, create, wait with the pods shown; ranks ready, or raise with
        everything deleted."""
        self.group_id = group_id
        try:
            return super().launch(group_id, choice, opts, threads, tmp, relay)
        except AdmissionStopped:
            why, said = self._wait.ended, self._wait.said
            name = self.manifests.name
            self.close()
            raise NbdistError(
                f"Kubernetes Job {name} failed before its ranks joined: {why}."
                + (f"\n--- its pod's last lines ---\n{said}" if said else "")
                + f"\nCheck that the image has the same Python, torch and nbdist as this "
                "notebook and that its pods reach the notebook at "
                f"{self.address[0]}: docs/multinode.md, \"Kubernetes\".") from None
        except BaseException as err:
            if self.created and self.progress and not self.letting_go:
                why = "Ctrl-C" if isinstance(err, KeyboardInterrupt) else type(err).__name__
                print(f"nbdist: deleted Kubernetes Job {self.manifests.name} and what it "
                      f"needed ({why} while its ranks were joining).", file=sys.stderr)
            self.close()
            raise
        finally:
            if self._wait is not None:
                self._wait.close()
                self._wait = None

    def listening(self, host, port, world_size):
        """Preflight, then create the Job (suspended), its Secret and Service, and resume it;
        when reattaching, say which Job's ranks are awaited."""
        if self.reattach_key:
            if self.progress:
                print(f"nbdist: reattaching to Kubernetes Job {self.manifests.namespace}/"
                      f"{self.manifests.name}: its {world_size} ranks connect to {host}:{port}.")
            return
        with open(self.key_file, encoding="ascii") as f:
            key_hex = f.read().strip()
        m = self.manifests = self.plan(f"nbdist-{self.group_id}", f"{host}:{port}", key_hex)
        if m.preflight is not None:
            self._preflight(m)
        job = dict(m.job, spec=dict(m.job["spec"], suspend=True))
        created = self.api.create(job)
        self.created.append(("Job", m.namespace, m.name))
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": m.name,
                 "uid": created["metadata"]["uid"]}
        for obj in (m.secret, m.service):
            obj = dict(obj, metadata=dict(obj["metadata"], ownerReferences=[owner]))
            self.api.create(obj)
            self.created.append((obj["kind"], m.namespace, obj["metadata"]["name"]))
        self.api.resume(m.namespace, m.name)
        if self.progress:
            print(f"nbdist: created Kubernetes Job {m.namespace}/{m.name} for {world_size} "
                  f"ranks; they connect to {host}:{port}. Ctrl-C deletes it.")
        self._wait = _Wait(self.api, m, world_size, self.progress)

    def _preflight(self, m: Manifests) -> None:
        """Run the preflight Job's pod to its end (its state shown), then delete the Job;
        :class:`NbdistError` naming the usual causes when it could not connect."""
        name = m.preflight["metadata"]["name"]
        self.api.create(m.preflight)
        self.created.append(("Job", m.namespace, name))
        wait = _Wait(self.api, m, 1, self.progress, pod=name)
        try:
            # in steps of WAKE_S: a Ctrl-C the OS gave another thread acts (a pod may stay
            # Pending for the whole join_timeout, 24 h by default)
            poll_until(wait.done.is_set, wait.done.wait, Deadline(self.join_timeout), cap=WAKE_S)
        finally:
            wait.close()
        phase = wait.phase
        said = self.api.log(m.namespace, wait.pod_name) if phase != "Succeeded" and \
            wait.pod_name else ""
        self.api.delete("Job", m.namespace, name)
        self.created.remove(("Job", m.namespace, name))
        if phase == "Succeeded":
            return
        port = m.preflight["spec"]["template"]["spec"]["containers"][0]["command"][-1]
        raise NbdistError(
            f"the preflight Job {m.namespace}/{name}"
            + (f" (pod {wait.pod_name})" if wait.pod_name else "")
            + f" could not connect back to this notebook at {self.address[0]}:{port} "
            f"({wait.ended or phase}); no Job was created for the ranks."
            + (f"\n--- the preflight pod said ---\n{said}" if said else "") + "\n" + CAUSES)

    def _admission(self, ws, config, relay, progress):
        admission = _K8sAdmission(ws, config, relay, False)
        admission.protect, admission.launcher = self.protect, self
        if self._wait is not None:
            admission.wake, admission.waiting = self._wait.wake, self._wait
        return admission

    def death_note(self) -> str:
        """What Kubernetes says about the group's pods that ended (``""``: nothing)."""
        if self.manifests is None:
            return ""
        parts = []
        m = self.manifests
        for pod in self.api.pods(m.namespace, selector(m.name)):
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Failed", "Succeeded") or pod["metadata"].get("deletionTimestamp"):
                parts.append(f"Kubernetes says pod {pod['metadata']['name']} is "
                             f"{phase or 'being deleted'}: {k8s_api.ended_reason(pod)}")
        return "; ".join(parts)

    def handle_fields(self):
        """The Job, its namespace and the pods' layout, saved for ``nbdist.reattach()``."""
        return {"job": self.manifests.name, "namespace": self.manifests.namespace,
                "tasks_per_node": self.nproc_per_node}

    def close(self, deadline=None) -> None:
        """Delete everything created (Job, Secret, Service, a preflight Job; foreground
        propagation), once -- but nothing after a reattach that got no ranks (they wait on);
        then as :meth:`AttachLauncher.close`."""
        letting_go = self.letting_go
        super().close(deadline)
        created, self.created = self.created, []
        if letting_go:
            return
        for kind, namespace, name in reversed(created):
            try:
                self.api.delete(kind, namespace, name)
            except (self.api.exception, OSError) as err:
                print(f"nbdist: could not delete Kubernetes {kind} {namespace}/{name} ({err}); "
                      f"run `kubectl delete -n {namespace} {kind.lower()} {name}`.",
                      file=sys.stderr)


class K8sProcess(EngineProcess):
    """A rank in the Job's pod: lost with what Kubernetes says about the pods."""

    launcher: K8sLauncher
    lost_advice = ("nbdist does not restart the ranks of a Kubernetes Job: call stop(), then "
                   "nbdist.start(..., on='k8s') again (a new Job)")

    @property
    def where(self) -> str:
        """``"pod 1: nbdist-ab12cd34-1"`` (the pod's host name)."""
        return f"pod {self.node}: {self.host}"

    def engine_note(self) -> str:
        """Kubernetes' word on the Job's pods."""
        try:
            return self.launcher.death_note()
        except (OSError, ValueError, getattr(self.launcher.api, "exception", OSError)):
            return ""


class _K8sAdmission(EngineAdmission):
    """Ranks of the Job: counted on the wait's display; their processes know their pod."""

    process_class = K8sProcess
    launcher: K8sLauncher
    waiting: Optional["_Wait"] = None

    def timed_out(self, missing, ranks, timeout):
        state = self.waiting.describe() if self.waiting else "?"
        return super().timed_out(missing, ranks, timeout) + f" ({state})"


class _Wait:
    """The pods' state while the ranks are not all there, read once a second on
    ``nbdist-k8s-wait`` and shown; :attr:`wake` turns readable if the Job fails first. With
    ``pod`` (the preflight Job's name) it follows that Job's one pod (:attr:`pod_name`, once the
    Job controller made it) to its end and sets :attr:`done`."""

    PERIOD = 1.0

    def __init__(self, api, m: Manifests, total: int, progress: bool, pod: Optional[str] = None):
        self.api, self.m, self.pod, self.t0 = api, m, pod, time.monotonic()
        self.pod_name = ""
        self.state = "Pending"
        self.phase = ""
        self.ended: Optional[str] = None
        self.said = ""
        self.done = threading.Event()
        self.wake, self._poke = socket.socketpair()
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=self.describe(), unit="pod" if pod else "rank")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbdist-k8s-wait", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        what = f"preflight Job {self.pod}" if self.pod else f"Kubernetes Job {self.m.name}"
        return f"{what}: {self.state}, waited {time.monotonic() - self.t0:.0f} s"

    def _read(self) -> None:
        ns = self.m.namespace
        if self.pod:
            self._read_preflight(ns)
            return
        pods = self.api.pods(ns, selector(self.m.name))
        job = self.api.job(ns, self.m.name)
        failed = [c for c in ((job or {}).get("status") or {}).get("conditions") or []
                  if c.get("type") == "Failed" and c.get("status") == "True"]
        dead = [p for p in pods if (p.get("status") or {}).get("phase") == "Failed"]
        if job is None or failed or dead:
            self.ended = ("the Job was deleted" if job is None else
                          "; ".join(f"pod {p['metadata']['name']}: {k8s_api.ended_reason(p)}"
                                    for p in dead)
                          or f"{failed[0].get('reason')}: {failed[0].get('message')}")
            if dead:
                self.said = self.api.log(ns, dead[0]["metadata"]["name"])
            self._poke.send(b"!")
            return
        running = sum((p.get("status") or {}).get("phase") == "Running" for p in pods)
        waiting = sorted({k8s_api.waiting_reason(p) for p in pods
                          if (p.get("status") or {}).get("phase") != "Running"})
        nodes = self.m.job["spec"]["completions"]
        self.state = f"{running} of {nodes} pods Running" + (
            f", waiting: {'; '.join(waiting)}" if waiting else "")

    def _read_preflight(self, ns: str) -> None:
        pods = self.api.pods(ns, selector(self.m.name, "preflight"))
        pod = pods[0] if pods else None
        if pod is None:  # not made yet, or the Job ended without one (its deadline passed)
            job = self.api.job(ns, self.pod)
            failed = [c for c in ((job or {}).get("status") or {}).get("conditions") or []
                      if c.get("type") == "Failed" and c.get("status") == "True"]
            if job is None or failed:
                self.phase = "Failed" if failed else "gone"
                self.ended = (f"{failed[0].get('reason')}: {failed[0].get('message')}"
                              if failed else "the preflight Job was deleted")
                self.done.set()
            self.state = self.phase or "Pending"
            return
        self.pod_name = pod["metadata"]["name"]
        self.phase = (pod.get("status") or {}).get("phase", "")
        if self.phase in ("Succeeded", "Failed"):
            self.ended = k8s_api.ended_reason(pod)
            self.done.set()
        self.state = k8s_api.waiting_reason(pod) if not self.ended else self.phase

    def _run(self) -> None:
        while True:
            try:
                self._read()
            except (OSError, ValueError, self.api.exception):
                pass  # the API server busy: try again
            if self.ended is not None:
                return
            if self.bar is not None:
                self.bar.set_description(self.describe())
            if self._stop.wait(self.PERIOD):
                return

    def joined(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(20.0)
        if self.bar is not None:
            if self.pod and self.phase == "Succeeded":
                self.bar.update(1)
            self.bar.set_description(self.describe())
            self.bar.close()
        self.wake.close()
        self._poke.close()
