"""The Kubernetes API as ``on="k8s"`` uses it: the official ``kubernetes`` client (the extra
``nbdist[k8s]``), imported only here and only when asked for.

Objects go in and come out as plain dicts (the API's own JSON, camelCase), so what
:func:`nbdist.k8s.manifests <nbdist.engines.k8s.manifests>` shows is what is sent. Configuration:
a kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``) when there is one, else the pod's in-cluster
service account -- the order of the client's own ``load_config``.
"""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Dict, List, Optional

from ..errors import NbdistError

#: where a pod's service account (its token, CA and namespace) is mounted
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
RBAC_HINT = ("the notebook's service account needs the Role in docs/multinode.md "
             "(\"Kubernetes\": jobs, pods, pods/log, services, secrets)")


def _kubeconfig_paths() -> List[str]:
    given = os.environ.get("KUBECONFIG")
    paths = given.split(os.pathsep) if given else [os.path.expanduser("~/.kube/config")]
    return [p for p in paths if p and os.path.exists(p)]


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and os.path.exists(
        os.path.join(SERVICE_ACCOUNT_DIR, "token"))


def own_namespace() -> Optional[str]:
    """The namespace of the pod this notebook runs in, from its service account's files
    (``None`` outside a pod)."""
    try:
        with open(os.path.join(SERVICE_ACCOUNT_DIR, "namespace"), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def missing() -> Optional[str]:
    """Why the engine cannot run here (``"kubernetes is not installed"``, ``"no kubeconfig or
    in-cluster config"``), or ``None``."""
    try:
        import kubernetes  # noqa: F401
    except ImportError:
        return "kubernetes is not installed (pip install 'nbdist[k8s]')"
    if not _kubeconfig_paths() and not _in_cluster():
        return "no kubeconfig or in-cluster config"
    return None


class Api:
    """A connection to the cluster: create, read, list and delete the group's objects."""

    def __init__(self):
        from kubernetes import client, config

        why = missing()
        if why:
            raise NbdistError(f"cannot reach Kubernetes: {why}.")
        self.exception = client.ApiException
        configuration = client.Configuration()
        paths = _kubeconfig_paths()
        if paths:
            config.load_kube_config(config_file=paths[0], client_configuration=configuration)
            self.config_namespace = _kubeconfig_namespace(config, paths[0])
        else:
            config.load_incluster_config(client_configuration=configuration)
            self.config_namespace = None
        self.client = client.ApiClient(configuration)
        self.core, self.batch = client.CoreV1Api(self.client), client.BatchV1Api(self.client)

    # ---- where the notebook runs --------------------------------------------------------------
    def own_pod(self) -> Optional[Dict[str, Any]]:
        """This notebook's pod (``None`` outside one); :class:`NbdistError` when it cannot be
        read (the service account may not get pods)."""
        namespace = own_namespace()
        if namespace is None:
            return None
        name = os.environ.get("HOSTNAME") or socket.gethostname()
        try:
            return self._json(self.core.read_namespaced_pod(name, namespace,
                                                            _preload_content=False))
        except self.exception as err:
            raise NbdistError(f"could not read this notebook's pod {namespace}/{name} "
                              f"({_said(err)}): {RBAC_HINT}; or pass image= and "
                              "namespace=.") from None

    def default_namespace(self) -> str:
        """The kubeconfig context's namespace, else the pod's, else ``"default"``."""
        return self.config_namespace or own_namespace() or "default"

    # ---- the group's objects ------------------------------------------------------------------
    def create(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        """Create ``obj`` in its namespace; the object the API returns (uid set)."""
        ns, kind = obj["metadata"]["namespace"], obj["kind"]
        call = {"Job": self.batch.create_namespaced_job, "Pod": self.core.create_namespaced_pod,
                "Service": self.core.create_namespaced_service,
                "Secret": self.core.create_namespaced_secret}[kind]
        try:
            return self._json(call(ns, obj, _preload_content=False))
        except self.exception as err:
            raise NbdistError(f"Kubernetes refused to create {kind} {ns}/{obj['metadata']['name']}:"
                              f" {_said(err)}" + (f"; {RBAC_HINT}" if err.status == 403 else "")
                              + ".") from None

    def resume(self, namespace: str, job: str) -> None:
        """Un-suspend the Job (its pods are created from now on)."""
        self.batch.patch_namespaced_job(job, namespace, {"spec": {"suspend": False}},
                                        _preload_content=False)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete with foreground propagation (the Job's pods go before it does); False if it was
        already gone."""
        call = {"Job": self.batch.delete_namespaced_job, "Pod": self.core.delete_namespaced_pod,
                "Service": self.core.delete_namespaced_service,
                "Secret": self.core.delete_namespaced_secret}[kind]
        try:
            call(name, namespace, propagation_policy="Foreground", _preload_content=False)
        except self.exception as err:
            if err.status == 404:
                return False
            raise
        return True

    def job(self, namespace: str, name: str) -> Optional[Dict[str, Any]]:
        """The Job (``None`` once it is gone)."""
        try:
            return self._json(self.batch.read_namespaced_job(name, namespace,
                                                             _preload_content=False))
        except self.exception as err:
            if err.status == 404:
                return None
            raise

    def pod(self, namespace: str, name: str) -> Optional[Dict[str, Any]]:
        """One pod (``None`` once it is gone)."""
        try:
            return self._json(self.core.read_namespaced_pod(name, namespace,
                                                            _preload_content=False))
        except self.exception as err:
            if err.status == 404:
                return None
            raise

    def pods(self, namespace: str, label_selector: str) -> List[Dict[str, Any]]:
        """The pods the selector picks (checked here too: every label ``key=value`` in it)."""
        out = self._json(self.core.list_namespaced_pod(namespace, label_selector=label_selector,
                                                       _preload_content=False))
        wanted = dict(part.split("=", 1) for part in label_selector.split(","))
        return [p for p in out.get("items", [])
                if all((p["metadata"].get("labels") or {}).get(k) == v
                       for k, v in wanted.items())]

    def log(self, namespace: str, pod: str, lines: int = 12) -> str:
        """The last lines the pod's container wrote (``""`` if none can be read)."""
        try:
            got = self.core.read_namespaced_pod_log(pod, namespace, tail_lines=lines,
                                                    _preload_content=False)
            return got.data.decode("utf-8", "replace").strip()
        except (self.exception, OSError):
            return ""

    @staticmethod
    def _json(response) -> Dict[str, Any]:
        return json.loads(response.data or b"{}")


def _kubeconfig_namespace(config, path: str) -> Optional[str]:
    try:
        _, current = config.list_kube_config_contexts(config_file=path)
    except Exception:  # noqa: BLE001 -- a kubeconfig without contexts: no namespace from it
        return None
    return (current or {}).get("context", {}).get("namespace")


def _said(err) -> str:
    """The API's own message in an ``ApiException`` (its Status ``message``), else its reason."""
    try:
        return json.loads(err.body).get("message") or f"{err.status} {err.reason}"
    except (TypeError, ValueError, AttributeError):
        return f"{err.status} {err.reason}"


def waiting_reason(pod: Dict[str, Any]) -> str:
    """Why a pod is not running yet, as Kubernetes says: the scheduler's message (``0/3 nodes are
    available: 3 Insufficient cpu``), a container's waiting reason (``ImagePullBackOff: ...``),
    or its phase."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return (cond.get("reason") or "Unschedulable") + (
                f": {cond['message']}" if cond.get("message") else "")
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses")
                                                            or []):
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return waiting["reason"] + (f": {waiting['message']}" if waiting.get("message") else "")
    return status.get("phase") or "Pending"


def ended_reason(pod: Dict[str, Any]) -> str:
    """What ended a pod: the container's termination (``OOMKilled, exit code 137``) or the pod's
    own reason (``Evicted: The node was low on resource: memory``)."""
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            return f"{term.get('reason') or 'terminated'}, exit code {term.get('exitCode')}"
    reason = status.get("reason") or status.get("phase") or "gone"
    return reason + (f": {status['message']}" if status.get("message") else "")
