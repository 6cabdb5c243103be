"""``on="k8s"``: a group whose ranks run as the pods of one Indexed Job, created from the notebook.

``nbdist.k8s.start(4, gpus=1)`` (or ``nbdist.start(4, on="k8s", ...)``, or ``%dist_start -n 4
--on k8s``) creates a Secret with the group key, a headless Service and an Indexed Job
(:mod:`.k8s_manifests`) after a preflight pod checked that pods reach the notebook; every pod runs
``python -m nbdist.worker --connect`` and its ranks join the notebook as an attached group's do.
``nbdist.k8s.manifests(...)`` returns the same objects without creating anything, to review them
(or keep them) first. In a notebook that runs in a pod, the image and the namespace default to the
pod's own, and the Job is owned by the pod, so deleting the notebook pod deletes the ranks.
See docs/multinode.md, "Kubernetes".
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..runtime.attach import parse_listen
from . import k8s_api
from .base import Engine
from .k8s_launcher import K8sLauncher
from .k8s_manifests import Manifests, build

__all__ = ["K8sEngine", "Manifests", "manifests", "start"]

RESOURCES = {"cpu": "2", "memory": "8Gi"}  #: each pod's requests by default
TTL = 600  #: s a finished Job (and its Secret, Service) stays before Kubernetes deletes it
ACTIVE_DEADLINE = 24 * 3600  #: s after which Kubernetes ends the Job whatever happens
KEEP_ALIVE_REFUSAL = ("keep_alive is not built yet for on='k8s': the ranks end with their kernel "
                      "(reattach() comes with the engine-agnostic keep_alive). Drop keep_alive.")


class K8sEngine(Engine):
    """The Kubernetes engine: one Indexed Job per group (see :func:`start` for the options)."""

    name = "k8s"
    options = ("image", "namespace", "resources", "gpus", "nodes", "node_selector",
               "tolerations", "service_account", "env", "keep_alive", "python", "listen", "ttl",
               "active_deadline", "preflight", "join_timeout", "progress", "protect")

    @classmethod
    def unusable(cls) -> Optional[str]:
        """``"kubernetes is not installed ..."`` or ``"no kubeconfig or in-cluster config"``
        where the cluster cannot be reached from here."""
        return k8s_api.missing()

    def launcher(self, world_size: int, image: Optional[str] = None,
                 namespace: Optional[str] = None, resources: Mapping[str, Any] = RESOURCES,
                 gpus: int = 0, nodes: Optional[int] = None,
                 node_selector: Optional[Mapping[str, str]] = None,
                 tolerations: Optional[List[Mapping[str, Any]]] = None,
                 service_account: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
                 keep_alive=None, python: str = "python", listen: Optional[str] = None,
                 ttl: int = TTL, active_deadline: int = ACTIVE_DEADLINE, preflight: bool = True,
                 join_timeout: float = 24 * 3600.0, progress: bool = True,
                 protect: Optional[bool] = None) -> K8sLauncher:
        """A :class:`K8sLauncher` for these options, checked (and the notebook's pod read)
        before anything is created."""
        fixed = _checked(world_size, resources, gpus, nodes, node_selector, tolerations, env,
                         python, ttl, active_deadline, keep_alive, image, listen)
        why = self.unusable()
        if why:
            raise ValueError(f"the engine 'k8s' cannot run here: {why}.")
        api = k8s_api.Api()
        image, namespace, owner, host = _context(api, image, namespace, listen)
        address = parse_listen(listen) if listen else (host, 0)

        def plan(name: str, connect: str, key_hex: str) -> Manifests:
            return build(name, namespace, image, connect, world_size, fixed["nodes"],
                         fixed["per_node"], fixed["resources"], gpus, node_selector, tolerations,
                         service_account, fixed["env"], owner, python, ttl, active_deadline,
                         preflight, key_hex)

        return K8sLauncher(plan, api, address, fixed["per_node"], join_timeout, progress,
                           protect, keep_alive)


def manifests(world_size: int, image: Optional[str] = None, namespace: Optional[str] = None,
              resources: Mapping[str, Any] = RESOURCES, gpus: int = 0,
              nodes: Optional[int] = None, node_selector: Optional[Mapping[str, str]] = None,
              tolerations: Optional[List[Mapping[str, Any]]] = None,
              service_account: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
              keep_alive=None, *, python: str = "python", listen: Optional[str] = None,
              ttl: int = TTL, active_deadline: int = ACTIVE_DEADLINE, preflight: bool = True,
              name: str = "nbdist-preview") -> Manifests:
    """The objects :func:`start` would create for these options, created nowhere: a
    :class:`Manifests` (``.job``, ``.service``, ``.secret``, ``.preflight`` as dicts, ``.yaml``).

    With ``image`` and ``namespace`` given, outside a pod, nothing is asked of a cluster (the
    ``kubernetes`` package is not needed either); otherwise the notebook's pod and the kubeconfig
    give the defaults, as for :func:`start`. The port the ranks dial is chosen when the group
    starts (``PORT`` here) unless ``listen="IP:PORT"`` names one; the Secret holds a placeholder
    until then, and ``name`` stands for ``nbdist-<group id>``
    (the group's id is made when it starts).
    """
    fixed = _checked(world_size, resources, gpus, nodes, node_selector, tolerations, env,
                     python, ttl, active_deadline, keep_alive, image, listen)
    api = None
    if image is None or namespace is None or k8s_api.own_namespace() is not None:
        why = k8s_api.missing()
        if why:
            raise ValueError(f"manifests() needs image= and namespace= here: {why}, so the "
                             "defaults (the notebook pod's image, the kubeconfig's namespace) "
                             "cannot be read.")
        api = k8s_api.Api()
    image, namespace, owner, host = _context(api, image, namespace, listen)
    port = parse_listen(listen)[1] if listen else 0
    return build(name, namespace, image, f"{host}:{port or 'PORT'}", world_size, fixed["nodes"],
                 fixed["per_node"], fixed["resources"], gpus, node_selector, tolerations,
                 service_account, fixed["env"], owner, python, ttl, active_deadline, preflight)


def start(world_size: int, image: Optional[str] = None, namespace: Optional[str] = None,
          resources: Mapping[str, Any] = RESOURCES, gpus: int = 0, nodes: Optional[int] = None,
          node_selector: Optional[Mapping[str, str]] = None,
          tolerations: Optional[List[Mapping[str, Any]]] = None,
          service_account: Optional[str] = None, env: Optional[Mapping[str, str]] = None,
          keep_alive=None, *, backend: Optional[str] = "auto", device: Optional[str] = "auto",
          timeout: float = 60.0, **options):
    """Create one Indexed Job whose pods run ``world_size`` ranks; return the
    :class:`~nbdist.Group` once they all joined.

    ``nodes`` pods (default: one per rank, or one per ``gpus`` ranks when ``gpus > 1``; they must
    divide ``world_size``), each asking for ``resources`` (Kubernetes quantities, default 2 CPUs
    and 8 GiB; memory is also the limit) and ``gpus`` ``nvidia.com/gpu``, placed by
    ``node_selector`` and ``tolerations``, run as ``service_account`` (default: none mounted), in
    ``image`` and ``namespace`` (default: the notebook pod's own, else the kubeconfig's). Every
    rank runs ``python -m nbdist.worker --connect IP:PORT`` with ``python`` (default ``"python"``
    on the image's PATH: it needs the same Python, torch and nbdist as the notebook), torchrun's
    variables, ``env``, and the group key read from a Secret mounted read-only. The ranks dial
    ``listen`` (``"IP:PORT"``; default the notebook pod's IP, port chosen by the system); a
    preflight pod checks that first (``preflight=False`` skips it).

    While pods wait the cell shows them (Pending with the scheduler's reason, ImagePullBackOff...);
    Ctrl-C deletes everything created, and so do ``stop()`` and the kernel's exit. A killed kernel
    ends the ranks too (they exit on a lost controller); the Job's ``ttl`` (s) then removes it,
    its Secret and its Service; ``active_deadline`` (s) bounds the whole run. ``keep_alive`` is
    accepted for the coming reattach() and refused until then. Other options are the group's
    (:class:`~nbdist.Group`); ``restart()`` is refused (start a new Job).
    """
    from ..runtime.engines import start_on

    given = dict(image=image, namespace=namespace, resources=resources, gpus=gpus, nodes=nodes,
                 node_selector=node_selector, tolerations=tolerations,
                 service_account=service_account, env=env, keep_alive=keep_alive)
    options.update({k: v for k, v in given.items() if v is not None})
    return start_on("k8s", world_size, backend, device, timeout, options)


def _context(api, image, namespace, listen) -> Tuple[str, str, Optional[Dict[str, str]], str]:
    """``(image, namespace, owner reference or None, host the ranks dial)`` from the options,
    then this notebook's pod, then the kubeconfig."""
    pod = api.own_pod() if api is not None else None
    if image is None:
        if pod is None:
            raise ValueError("image= is required: this notebook does not run in a pod whose image "
                             "the ranks could use. Pass an image with the same Python, torch and "
                             "nbdist as this notebook.")
        containers = pod["spec"]["containers"]
        image = next((c for c in containers if c["name"] == "notebook"), containers[0])["image"]
    namespace = namespace or (pod["metadata"]["namespace"] if pod else api.default_namespace())
    owner = None
    if pod is not None and pod["metadata"]["namespace"] == namespace:
        owner = {"apiVersion": "v1", "kind": "Pod", "name": pod["metadata"]["name"],
                 "uid": pod["metadata"]["uid"]}
    if listen:
        host = parse_listen(listen)[0]
    elif pod is not None and (pod.get("status") or {}).get("podIP"):
        host = pod["status"]["podIP"]
    else:
        from .slurm import default_host

        host = default_host()
    return image, namespace, owner, host


def _checked(world_size, resources, gpus, nodes, node_selector, tolerations, env, python, ttl,
             active_deadline, keep_alive, image, listen) -> Dict[str, Any]:
    """The options checked (``ValueError``/``TypeError`` saying what was expected) and
    ``nodes``, ``per_node``, ``resources``, ``env`` worked out."""
    from .slurm import layout

    if keep_alive is not None:
        raise ValueError(KEEP_ALIVE_REFUSAL)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be an int >= 0 (nvidia.com/gpu per pod), got {gpus!r}")
    for what, value in (("resources", resources), ("node_selector", node_selector),
                        ("env", env)):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(f"{what} must be a dict, e.g. {{'cpu': '4', 'memory': '16Gi'}} for "
                            f"resources, got {type(value).__name__} {value!r}")
    if tolerations is not None and (isinstance(tolerations, Mapping) or not all(
            isinstance(t, Mapping) for t in tolerations)):
        raise TypeError("tolerations must be a list of dicts, e.g. [{'key': 'nvidia.com/gpu', "
                        f"'operator': 'Exists', 'effect': 'NoSchedule'}}], got {tolerations!r}")
    for what, value in (("ttl", ttl), ("active_deadline", active_deadline)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int of seconds, got {value!r}")
    if not isinstance(python, str) or not python:
        raise ValueError(f"python must be the interpreter's name or path in the image, got "
                         f"{python!r}")
    if image is not None and (not isinstance(image, str) or not image):
        raise ValueError(f"image must be a container image name, got {image!r}")
    if listen is not None:
        parse_listen(listen)
    if nodes is None and gpus > 1:
        if world_size % gpus:
            raise ValueError(f"world_size={world_size} is not a multiple of gpus={gpus}: without "
                             "nodes= every pod runs one rank per GPU. Pass nodes=, or a "
                             f"world_size that is a multiple of {gpus}.")
        nodes = world_size // gpus
    elif nodes is None:
        nodes = world_size
    nodes, per_node = layout(world_size, nodes, None)
    return {"nodes": nodes, "per_node": per_node, "env": dict(env or {}),
            "resources": dict(RESOURCES if resources is None else resources)}
