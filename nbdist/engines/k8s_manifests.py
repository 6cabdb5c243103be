"""The objects ``on="k8s"`` creates, as plain dicts: nothing here imports the Kubernetes client.

* a **Secret** holding the group key (``key.hex``), mounted read-only into the rank pods at
  :data:`KEY_DIR`; the key is never in a pod spec, a command line or an environment variable;
* a headless **Service** (``clusterIP: None``) that is the Job's ``subdomain``, so every pod has
  the stable name ``<job>-<index>.<service>``;
* an **Indexed Job**: ``completions = parallelism = nodes``, ``completionMode: Indexed``,
  ``backoffLimit: 0`` (nbdist does not restart ranks), ``ttlSecondsAfterFinished`` (the Job and,
  through their owner references, its Secret and Service go by themselves once the ranks exited,
  as they do when the kernel is lost) and ``activeDeadlineSeconds`` (a bound on the whole run);
* a **preflight pod**: same image, labels, node selector and tolerations as the ranks, it only
  opens a TCP connection to the notebook and says whether it could.

Every pod runs ``python -m nbdist.worker --connect HOST:PORT --key-file KEY`` with torchrun's
variables; the pod's index comes from the Job controller's annotation :data:`INDEX`. A pod that
holds several ranks (``nodes < world_size``) starts one worker per rank from a small ``sh`` loop.
"""
from __future__ import annotations

import base64
import copy
import shlex
from typing import Any, Dict, List, Optional

KEY_DIR = "/var/run/nbdist/key"  #: where the Secret is mounted in the rank pods
KEY_NAME = "key.hex"  #: the Secret's one key (the group key, hex)
INDEX = "batch.kubernetes.io/job-completion-index"  #: the Job controller's annotation on a pod
PLACEHOLDER_KEY = "<the group key: nbdist.k8s.start writes it>"
GPU = "nvidia.com/gpu"  #: the extended resource NVIDIA's device plugin offers

#: the preflight pod's program: only the standard library, so it says something even where the
#: image lacks nbdist
PREFLIGHT = (
    "import socket, sys\n"
    "host, port = sys.argv[1], int(sys.argv[2])\n"
    "try:\n"
    "    socket.create_connection((host, port), timeout=10).close()\n"
    "except OSError as err:\n"
    "    print(f'nbdist preflight: cannot reach the notebook at {host}:{port}: {err}')\n"
    "    sys.exit(1)\n"
    "print(f'nbdist preflight: reached the notebook at {host}:{port}')\n")


def labels(name: str, component: str) -> Dict[str, str]:
    """The labels of every object of the group ``name`` (``component``: ranks, preflight...)."""
    return {"app.kubernetes.io/name": "nbdist", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": "nbdist"}


def selector(name: str, component: str = "ranks") -> str:
    """The label selector of the group's pods of ``component``."""
    return (f"app.kubernetes.io/instance={name},app.kubernetes.io/component={component}")


class Manifests:
    """What :func:`nbdist.k8s.start <nbdist.engines.k8s.start>` creates: :attr:`secret`,
    :attr:`service`, :attr:`job` and :attr:`preflight` (``None`` when it is off) as dicts, in
    :attr:`objects`, and all of them as one YAML document stream in :attr:`yaml`.

    ``start`` creates the Job suspended, then the Secret and the Service with an owner reference
    to the Job (so whatever deletes the Job -- ``stop()``, its TTL, the notebook pod's deletion --
    deletes them too), then resumes the Job; these references need the Job's uid, which only
    exists once it is created, so they are not shown here. The key in the Secret is a placeholder
    until ``start`` writes the real one.
    """

    def __init__(self, secret, service, job, preflight):
        self.secret, self.service, self.job, self.preflight = secret, service, job, preflight

    @property
    def objects(self) -> List[Dict[str, Any]]:
        """The objects, in the order ``start`` creates them (preflight pod first)."""
        return [o for o in (self.preflight, self.job, self.secret, self.service) if o is not None]

    @property
    def name(self) -> str:
        """The Job's name (the Service's and the Secret's start with it)."""
        return self.job["metadata"]["name"]

    @property
    def namespace(self) -> str:
        """Where they are created."""
        return self.job["metadata"]["namespace"]

    @property
    def yaml(self) -> str:
        """All objects as YAML documents (``kubectl apply -f`` reads them)."""
        import yaml

        return yaml.safe_dump_all(self.objects, sort_keys=False)

    def __iter__(self):
        return iter(self.objects)

    def __repr__(self) -> str:
        kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in self.objects)
        return f"<nbdist.k8s.Manifests in namespace {self.namespace}: {kinds}>"


def build(name: str, namespace: str, image: str, address: str, world_size: int, nodes: int,
          per_node: int, resources: Dict[str, str], gpus: int,
          node_selector: Optional[Dict[str, str]], tolerations: Optional[List[Dict[str, Any]]],
          service_account: Optional[str], env: Dict[str, str], owner: Optional[Dict[str, str]],
          python: str, ttl: int, active_deadline: int, preflight: bool,
          key_hex: Optional[str] = None) -> Manifests:
    """The objects of one group (arguments checked by the caller)."""
    meta = {"name": name, "namespace": namespace, "labels": labels(name, "ranks")}
    owners = {"ownerReferences": [owner]} if owner else {}
    secret_data = ({"data": {KEY_NAME: base64.b64encode(key_hex.encode()).decode()}}
                   if key_hex else {"stringData": {KEY_NAME: PLACEHOLDER_KEY}})
    secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
              "metadata": dict(meta, name=f"{name}-key"), **secret_data}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": dict(meta),
               "spec": {"clusterIP": "None", "selector": {
                   "app.kubernetes.io/instance": name, "app.kubernetes.io/component": "ranks"},
                   # the names resolve while pods start, before any readiness
                   "publishNotReadyAddresses": True}}
    pod = _pod_spec(name, image, address, world_size, per_node, resources, gpus, env, python)
    pod.update(_placement(node_selector, tolerations, service_account))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": dict(meta, **copy.deepcopy(owners)),
           "spec": {"completions": nodes, "parallelism": nodes, "completionMode": "Indexed",
                    "backoffLimit": 0, "ttlSecondsAfterFinished": int(ttl),
                    "activeDeadlineSeconds": int(active_deadline),
                    "template": {"metadata": {"labels": labels(name, "ranks")}, "spec": pod}}}
    check = None
    if preflight:
        host, _, port = address.rpartition(":")
        check = {"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": f"{name}-preflight", "namespace": namespace,
                              "labels": labels(name, "preflight"), **copy.deepcopy(owners)},
                 "spec": {"restartPolicy": "Never", "activeDeadlineSeconds": 600,
                          "automountServiceAccountToken": False,
                          "containers": [{"name": "preflight", "image": image,
                                          "command": [python, "-c", PREFLIGHT, host, port],
                                          "resources": {"requests": {"cpu": "10m",
                                                                     "memory": "64Mi"},
                                                        "limits": {"memory": "256Mi"}}}],
                          **_placement(node_selector, tolerations, service_account)}}
    return Manifests(secret, service, job, check)


def _pod_spec(name, image, address, world_size, per_node, resources, gpus, env, python):
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}}
    variables: List[Dict[str, Any]] = [
        {"name": "GROUP_RANK", "valueFrom": index},
        {"name": "WORLD_SIZE", "value": str(world_size)},
        {"name": "LOCAL_WORLD_SIZE", "value": str(per_node)}]
    worker = [python, "-m", "nbdist.worker", "--connect", address, "--key-file",
              f"{KEY_DIR}/{KEY_NAME}"]
    if per_node == 1:
        variables += [{"name": "RANK", "valueFrom": index}, {"name": "LOCAL_RANK", "value": "0"}]
        command = worker
    else:
        command = ["/bin/sh", "-c", spawn_script(worker, per_node)]
    variables += [{"name": str(k), "value": str(v)} for k, v in sorted(env.items())]
    requests = {str(k): str(v) for k, v in resources.items()}
    # memory limited to what is asked (a rank over it is OOMKilled and says so); CPU not limited
    # (a limit throttles collectives); GPUs are asked for as limits, as Kubernetes requires
    limits = {k: v for k, v in requests.items() if k == "memory"}
    if gpus:
        requests[GPU] = limits[GPU] = str(gpus)
    return {"restartPolicy": "Never", "subdomain": name,
            # the ranks need no access to the Kubernetes API
            "automountServiceAccountToken": False,
            "containers": [{"name": "rank", "image": image, "command": command, "env": variables,
                            "resources": {"requests": requests, **({"limits": limits}
                                                                   if limits else {})},
                            "volumeMounts": [
                                {"name": "nbdist-key", "mountPath": KEY_DIR, "readOnly": True},
                                {"name": "dshm", "mountPath": "/dev/shm"}]}],
            "volumes": [
                # 0444: the files of a Secret volume belong to root; the image may run as
                # another user (Jupyter images do), which must read the key
                {"name": "nbdist-key", "secret": {"secretName": f"{name}-key",
                                                  "defaultMode": 0o444}},
                # the container runtime's 64 MiB /dev/shm is too small for NCCL and DataLoaders
                {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}


def _placement(node_selector, tolerations, service_account) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if node_selector:
        out["nodeSelector"] = {str(k): str(v) for k, v in node_selector.items()}
    if tolerations:
        out["tolerations"] = [dict(t) for t in tolerations]
    if service_account:
        out["serviceAccountName"] = service_account
        out["automountServiceAccountToken"] = True
    return out


def spawn_script(worker: List[str], per_node: int) -> str:
    """The ``sh`` program of a pod that holds ``per_node`` ranks: one worker each, ranks
    ``GROUP_RANK * per_node + i``; SIGTERM (the pod's deletion) is passed on to them."""
    cmd = " ".join(shlex.quote(a) for a in worker)
    return (f'pids=""; trap \'kill -TERM $pids 2>/dev/null\' TERM INT; i=0; '
            f'while [ $i -lt {per_node} ]; do '
            f'RANK=$((GROUP_RANK * {per_node} + i)) LOCAL_RANK=$i {cmd} & pids="$pids $!"; '
            f'i=$((i + 1)); done; '
            f'code=0; for p in $pids; do wait $p || code=$?; done; exit $code')
