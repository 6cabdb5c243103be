"""A Kubernetes for the on="k8s" tests, without a cluster (none can be had on these machines).

* :class:`Emulator` -- kmock's ``KubernetesEmulator`` (an in-memory API server answering the real
  client's HTTP requests) on a local port, in a thread, with what an API server adds that kmock
  leaves to its users: a ``uid`` on every created object, and pod logs.
* :class:`Controller` -- plays the Job controller, the garbage collector and the kubelet: for a
  resumed Indexed Job it creates one pod per index (the template's labels, the index annotation,
  the hostname) and runs each as local processes -- the pod's command and environment, the index
  resolved from the annotation, the Secret written to a private directory in place of its mount.
  ``python`` in a pod is this interpreter, as an image with nbdist would have it. Pods that ended
  get their phase and exit code; a deleted Job takes its pods (and their processes) with it.
  ``run=False`` leaves pods Pending with the scheduler's message instead; ``blocked=True`` makes
  the preflight pod dial a port nothing listens on, as a NetworkPolicy would drop it.
"""
import asyncio
import base64
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

kmock = pytest.importorskip("kmock", reason="kmock (the Kubernetes API emulation) is not "
                                            "installed: pip install -e '.[dev]'")
client = pytest.importorskip("kubernetes.client", reason="kubernetes is not installed: pip "
                                                         "install 'nbdist[k8s]'")

RESOURCES = ("v1/pods", "v1/services", "v1/secrets", "batch/v1/jobs")
UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient cpu."}


class _Server(kmock.KubernetesEmulator):
    logs: dict = {}

    async def _handle(self, request):
        import aiohttp.web

        if request.resource is not None and request.method == "POST" and isinstance(
                request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ"))
        if request.method == "GET" and str(request.url.path).endswith("/log"):
            name = str(request.url.path).split("/")[-2]
            return aiohttp.web.Response(text=self.logs.get(name, ""))
        return await super()._handle(request)


class Emulator:
    """The API emulation on ``url``; :meth:`kubeconfig` writes a kubeconfig for it."""

    def __init__(self):
        self._ready, self._stop = threading.Event(), None
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the kmock server did not start")

    def _serve(self):
        async def main():
            self._stop = asyncio.Event()
            async with _Server() as handler, kmock.Server(handler) as server:
                for res in RESOURCES:
                    handler.resources[res] = {}
                self.handler, self.url = handler, str(server.url).rstrip("/")
                self.loop = asyncio.get_running_loop()
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    def stop(self):
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def kubeconfig(self, path: Path, namespace: str = "team") -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: kmock, cluster: {{server: '{self.url}'}}}}]\n"
            "users: [{name: nb, user: {token: not-checked}}]\n"
            f"contexts: [{{name: nb, context: {{cluster: kmock, user: nb, namespace: {namespace}}}}}]\n"
            "current-context: nb\n")
        return path

    def api(self):
        """The real client, configured for the emulation."""
        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)

    def requests(self, method: str, path_part: str = ""):
        """The requests made so far with ``method`` whose path contains ``path_part``."""
        return [r for r in list(self.handler[method.lower()]) if path_part in str(r.url.path)]

    def stored(self, plural: str):
        """``{(namespace, name): object}`` of the live objects of a resource (``"jobs"``)."""
        out = {}
        for (res, ns, name), obj in list(self.handler.objects.items()):
            if res.plural == plural and not obj.deleted:
                out[(ns, name)] = obj.raw
        return out


class Controller:
    """The Job controller, the garbage collector and the kubelet, for the emulation's pods."""

    def __init__(self, emulator: Emulator, run: bool = True, blocked: bool = False):
        self.em, self.run, self.blocked = emulator, run, blocked
        self.core = client.CoreV1Api(emulator.api())
        self.batch = client.BatchV1Api(emulator.api())
        self.home = Path(tempfile.mkdtemp(prefix="nbdist-k8s-pods-"))
        (self.home / "bin").mkdir()
        wrapper = self.home / "bin" / "python"  # the image's python: this interpreter
        wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
        wrapper.chmod(0o755)
        self.procs = {}  #: (namespace, pod) -> Popen
        self.jobs = {}  #: (namespace, job) -> the names of its pods
        self.reported = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k8s-controller", daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.wait(0.1):
            try:
                self._step()
            except client.ApiException:
                pass  # an object went between two calls: next round

    def _step(self):
        jobs = self.em.stored("jobs")
        for key, job in jobs.items():
            if key not in self.jobs and not job["spec"].get("suspend"):
                self.jobs[key] = [self._start_pod(key[0], job, index)
                                  for index in range(job["spec"]["completions"])]
        for key in [k for k in self.jobs if k not in jobs]:  # deleted: its pods go (GC)
            for pod in self.jobs.pop(key):
                if (key[0], pod) in self.procs:
                    self._end(key[0], pod)
                self._delete_pod(key[0], pod)
        pods = self.em.stored("pods")
        for (ns, name), pod in pods.items():
            labels = pod["metadata"].get("labels") or {}
            if labels.get("app.kubernetes.io/component") == "preflight" and \
                    (ns, name) not in self.procs and (ns, name) not in self.reported:
                self._run(ns, pod)
        for (ns, name), proc in list(self.procs.items()):
            if (ns, name) not in pods:
                self._end(ns, name)
            elif proc.poll() is not None and (ns, name) not in self.reported:
                self.reported.add((ns, name))
                self._finished(ns, name, proc.returncode)

    def _start_pod(self, ns, job, index):
        name = job["metadata"]["name"]
        template = job["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-{index}-x{index}", "namespace": ns,
                            "labels": dict(template["metadata"]["labels"], **{
                                "job-name": name}),
                            "annotations": {"batch.kubernetes.io/job-completion-index":
                                            str(index)},
                            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                                 "name": name, "uid": job["metadata"]["uid"]}]},
               "spec": dict(template["spec"], hostname=f"{name}-{index}"),
               "status": {"phase": "Pending"}}
        if not self.run:
            pod["status"]["conditions"] = [UNSCHEDULABLE]
        self.core.create_namespaced_pod(ns, pod, _preload_content=False)
        if self.run:
            self._run(ns, pod)
        return pod["metadata"]["name"]

    def _run(self, ns, pod):
        """The pod's one container as local processes: env, index and Secret resolved."""
        name = pod["metadata"]["name"]
        spec = pod["spec"]
        (container,) = spec["containers"]
        local = {}
        for vol in spec.get("volumes", []):
            if "secret" in vol:
                secret = self.core.read_namespaced_secret(vol["secret"]["secretName"], ns)
                d = Path(tempfile.mkdtemp(prefix="secret-", dir=self.home))
                for k, v in (secret.data or {}).items():
                    (d / k).write_bytes(base64.b64decode(v))
                    (d / k).chmod(vol["secret"].get("defaultMode", 0o644))
                local[vol["name"]] = str(d)
        mounts = {m["mountPath"]: local[m["name"]] for m in container.get("volumeMounts", [])
                  if m["name"] in local}

        def resolved(text):
            for path, there in mounts.items():
                text = text.replace(path, there)
            return text

        env = {"PATH": f"{self.home / 'bin'}:/usr/bin:/bin",
               "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the image's nbdist
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = resolved(var["value"])
            else:
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
                env[var["name"]] = pod["metadata"]["annotations"][m.group(1)] if m else \
                    {"metadata.name": name, "metadata.namespace": ns,
                     "status.podIP": "127.0.0.1"}[path]
        argv = [resolved(a) for a in container["command"]]
        if self.blocked and "preflight" in name:
            argv[-1] = str(_closed_port())
        log = open(self.home / f"{name}.log", "w")
        self.procs[(ns, name)] = subprocess.Popen(argv, env=env, stdout=log,
                                                  stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL)
        log.close()
        self._patch(ns, name, {"status": {"phase": "Running", "podIP": "127.0.0.1"}})

    def _finished(self, ns, name, code):
        self.em.handler.logs[name] = (self.home / f"{name}.log").read_text()
        self._patch(ns, name, {"status": {
            "phase": "Succeeded" if code == 0 else "Failed",
            "containerStatuses": [{"name": "c", "ready": False, "restartCount": 0,
                                   "image": "x", "imageID": "", "state": {"terminated": {
                                       "exitCode": code, "reason": "Completed" if code == 0
                                       else "Error"}}}]}})
        job = name.rsplit("-", 2)[0]
        if (ns, job) in self.jobs:
            mine = [(ns, p) for p in self.jobs[(ns, job)] if (ns, p) in self.procs]
            if all(self.procs[k].poll() is not None for k in mine):
                failed = any(self.procs[k].returncode for k in mine)
                self._patch(ns, job, {"status": {"conditions": [{
                    "type": "Failed" if failed else "Complete", "status": "True"}]}},
                    kind="job")

    def _patch(self, ns, name, body, kind="pod"):
        try:
            if kind == "pod":
                self.core.patch_namespaced_pod(name, ns, body, _preload_content=False)
            else:
                self.batch.patch_namespaced_job(name, ns, body, _preload_content=False)
        except client.ApiException:
            pass  # deleted meanwhile

    def _delete_pod(self, ns, name):
        try:
            self.core.delete_namespaced_pod(name, ns, _preload_content=False)
        except client.ApiException:
            pass

    def _end(self, ns, name):
        """The kubelet's end of a deleted pod: SIGTERM, then SIGKILL after a grace period."""
        proc = self.procs.pop((ns, name))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def running(self):
        """The pods whose processes still run."""
        return sorted(k[1] for k, p in self.procs.items() if p.poll() is None)

    def wait_exited(self, timeout=120.0):
        """Until every pod's processes ended and their ends were reported to the API (``False``
        if some still run after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while (self.running() or any(k not in self.reported for k in list(self.procs))) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.running()

    def stop(self):
        self._stop.set()
        self._thread.join(30)
        for key in list(self.procs):
            self._end(*key)


def _closed_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: the connection is refused, as a policy drops it
    return port
