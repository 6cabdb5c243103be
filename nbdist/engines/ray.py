"""``on="ray"``: a persistent group whose ranks run in Ray actors, driven cell by cell.

``nbdist.ray.start(4, num_gpus=1, placement="SPREAD", address="auto")`` (or
``nbdist.start(4, on="ray", ...)``, or ``%dist_start -n 4 --on ray --num-gpus 1 ...``) asks Ray for
one placement group of four bundles, puts one actor on each, and each actor runs
``python -m nbdist.worker --connect`` -- the worker every group runs, so ``%%dist``, jobs, stacks,
Ctrl-C, pdb and signing work as on local ranks. Unlike Ray Train, whose workers are rebuilt for
every ``fit()``, the ranks stay up between cells until ``stop()``. See docs/multinode.md.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Dict, Optional

from ..runtime.attach import parse_listen
from .base import Engine

__all__ = ["PLACEMENTS", "RayEngine", "start"]

PLACEMENTS = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")  #: Ray's placement strategies


class RayEngine(Engine):
    """The Ray engine: one placement group and one actor per rank (see :func:`start`)."""

    name = "ray"
    options = ("num_cpus", "num_gpus", "resources", "placement", "address", "runtime_env",
               "listen", "python", "placement_timeout", "join_timeout", "progress",
               "protect")

    @classmethod
    def unusable(cls) -> Optional[str]:
        """``"ray is not installed"`` where ``import ray`` would fail."""
        try:
            found = importlib.util.find_spec("ray") is not None
        except (ImportError, ValueError):  # sys.modules["ray"] = None: hidden
            found = False
        if not found:
            return "ray is not installed (pip install 'nbdist[ray]')"
        return None

    @classmethod
    def ended(cls, handle: Dict[str, Any]) -> str:
        """``""`` while every named actor and the placement group of the keep_alive ``handle``
        exist, else what is gone -- and what was left of the group is removed (a group missing a
        rank cannot be taken back)."""
        from ..errors import NbdistError
        from . import ray_session

        try:
            session = ray_session.connect(handle.get("ray_address"))
        except NbdistError as err:
            return f"Ray is not reachable: {err}"
        try:
            actors, pg = ray_session.find(handle["actors"], handle["pg"])
            left = [a for a in actors if a is not None]
            if len(left) == len(actors) and pg is not None:
                return ""
            session.tear_down(left, pg)
            session = None
            return (f"the Ray group {handle['job']} has {len(left)} of its {len(actors)} actors"
                    + ("" if pg is not None else " and no placement group")
                    + (" (the rest was removed)" if left or pg is not None else ""))
        finally:
            if session is not None:
                session.release()

    def reattach(self, handle: Dict[str, Any], join_timeout: float, progress: bool):
        """A :class:`~.ray_launcher.RayLauncher` that takes back the ranks of ``handle``."""
        from .ray_launcher import RayLauncher

        return RayLauncher.reattach(handle, join_timeout, progress)

    def launcher(self, world_size: int, num_cpus: float = 1, num_gpus: float = 0,
                 resources: Optional[Dict[str, float]] = None, placement: str = "PACK",
                 address: Optional[str] = None, runtime_env: Optional[Dict[str, Any]] = None,
                 listen: Optional[str] = None, python: Optional[str] = None,
                 placement_timeout: float = 120.0, join_timeout: float = 600.0,
                 progress: bool = True, protect: Optional[bool] = None):
        """A :class:`~.ray_launcher.RayLauncher` for these options, checked before Ray is asked."""
        from .ray_launcher import RayLauncher

        bundle = bundle_of(num_cpus, num_gpus, resources)
        if not isinstance(placement, str) or placement.upper() not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got "
                             f"{placement!r}")
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be None (start Ray here), 'auto' or 'ray://HOST:PORT', "
                            f"got {address!r}")
        if runtime_env is not None and not isinstance(runtime_env, dict):
            raise TypeError(f"runtime_env must be a dict (e.g. {{'env_vars': {{...}}}}), got "
                            f"{type(runtime_env).__name__}")
        for name, v in (("placement_timeout", placement_timeout), ("join_timeout", join_timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        return RayLauncher(bundle, placement.upper(), address, runtime_env,
                           parse_listen(listen) if listen else None, python,
                           float(placement_timeout), float(join_timeout), progress, protect)


def bundle_of(num_cpus, num_gpus, resources) -> Dict[str, float]:
    """One rank's placement-group bundle; ``ValueError`` on a negative or empty request."""
    bundle: Dict[str, float] = {}
    for name, key, v in (("num_cpus", "CPU", num_cpus), ("num_gpus", "GPU", num_gpus)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{name} must be a number >= 0 (Ray's units per rank), got {v!r}")
        if v:
            bundle[key] = float(v)
    if resources is not None:
        if not isinstance(resources, dict):
            raise TypeError(f"resources must be a dict of Ray's custom resources per rank "
                            f"(e.g. {{'TPU': 1}}), got {type(resources).__name__}")
        for k, v in resources.items():
            if k in ("CPU", "GPU"):
                raise ValueError(f"resources={{{k!r}: ...}}: pass num_{k.lower()}s= instead")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"resources[{k!r}] must be a number >= 0, got {v!r}")
            if v:
                bundle[str(k)] = float(v)
    if not bundle:
        raise ValueError("each rank must ask Ray for something (num_cpus=0, num_gpus=0 and no "
                         "resources): Ray cannot place an empty bundle. Pass num_cpus=1.")
    return bundle


def start(world_size: int, num_cpus: float = 1, num_gpus: float = 0,
          resources: Optional[Dict[str, float]] = None, placement: str = "PACK",
          address: Optional[str] = None, runtime_env: Optional[Dict[str, Any]] = None,
          keep_alive=None, *, backend: Optional[str] = "auto", device: Optional[str] = "auto",
          timeout: float = 60.0, **options):
    """Start ``world_size`` ranks in Ray actors; return the :class:`~nbdist.Group` once they all
    joined.

    Each rank gets one bundle of ``num_cpus`` CPUs, ``num_gpus`` GPUs and ``resources`` (Ray's
    custom resources), all in one placement group placed by ``placement`` (``"PACK"``,
    ``"SPREAD"``, ``"STRICT_SPREAD"``: one node per rank, or ``"STRICT_PACK"``). If Ray cannot
    place it within ``placement_timeout`` seconds (default 120) the error names what was asked and
    what the cluster has free, and the placement group is removed. ``address``: ``None`` starts
    Ray in this kernel (a laptop), ``"auto"`` joins the cluster this machine is on, and
    ``"ray://HOST:10001"`` goes through the Ray Client. ``runtime_env`` is the actors' (e.g.
    ``{"env_vars": {...}}``); nbdist and torch must be importable there.

    Ranks are numbered by Ray node id, then GPU id; each gets torchrun's variables (``RANK``,
    ``LOCAL_RANK``, ``GROUP_RANK``, ...) and ``CUDA_VISIBLE_DEVICES`` listing its node's GPUs.
    Before any rank starts, every actor dials the notebook (``listen``, ``"HOST:PORT"``; default:
    loopback for a Ray started here, else this node's address): a blocked address is named with
    its usual causes. ``stop()``, the kernel's exit and a killed kernel leave no actor and no
    placement group.

    ``keep_alive`` (``"30m"``, or seconds) needs a running cluster (``address="auto"`` or its
    address; refused with ``address=None``, whose Ray ends with the kernel): the actors and the
    placement group are then detached and named after the group, so they outlive this kernel, and
    ``nbdist.reattach()`` in a new kernel takes the ranks back with their variables. With no
    kernel for that long the ranks exit and the actors remove themselves and the placement
    group. Other options: ``python`` (the workers' interpreter; default the actors'),
    ``join_timeout``, ``progress``, ``protect``, and the group's (:class:`~nbdist.Group`);
    ``restart()`` is refused (start a new group).
    """
    from ..runtime.engines import start_on

    options.update(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                   placement=placement, address=address, runtime_env=runtime_env,
                   keep_alive=keep_alive)
    return start_on("ray", world_size, backend, device, timeout, options)
