"""Engines that place ranks, found by name: ``nbdist.start(world_size, on="slurm", ...)``.

An engine (SLURM, Ray, Kubernetes...) lives above the runtime, in :mod:`nbdist.engines` or in a
third-party package, and is found here by name only: the built-in ones from :data:`BUILTIN`, the
others through the entry-point group :data:`ENTRY_POINT_GROUP` (``name = "package.module:Class"``).
Nothing is imported before it is asked for, so ``nbdist.start()`` never imports an engine it does
not use. The class an entry point names has

* ``name`` and ``options`` (the engine's own keyword options, a tuple of names),
* ``unusable()`` (a classmethod): ``None`` where the engine can run, else why not (``"no sbatch on
  PATH"``), and
* ``launcher(world_size, **options)``: a :class:`~nbdist.runtime.launcher.Launcher` that places the
  ranks, each running ``python -m nbdist.worker --connect`` (so every feature of an attached group
  works the same); it raises on bad options before anything is submitted.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Optional

from ..errors import NbdistError

ENTRY_POINT_GROUP = "nbdist.engines"  #: where third-party engines register
#: options every engine's group takes, beside its own and the group's
ENGINE_OPTIONS = ("keep_alive",)
#: the engines nbdist brings (``"local"``: this machine's forkserver/spawn workers, built in here)
BUILTIN = {"local": "", "slurm": "nbdist.engines.slurm:SlurmEngine",
           "ray": "nbdist.engines.ray:RayEngine", "k8s": "nbdist.engines.k8s:K8sEngine"}


def engine_targets() -> Dict[str, str]:
    """Every engine name -> ``"module:attr"`` (``""`` for ``"local"``), built-in ones first; an
    entry point cannot replace a built-in engine."""
    from importlib.metadata import entry_points

    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def load_engine(name: str):
    """The engine class registered as ``name``; ``ValueError`` listing the names on a miss."""
    targets = engine_targets()
    if name not in targets:
        raise ValueError(f"unknown engine on={name!r}; the engines are: "
                         f"{', '.join(repr(n) for n in targets)} (a third-party engine registers "
                         f"under the entry-point group {ENTRY_POINT_GROUP!r}).")
    if not targets[name]:
        return None  # "local": runtime.api starts it directly
    module, _, attr = targets[name].partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def engines_here() -> Dict[str, Optional[str]]:
    """Every engine name -> ``None`` where it can run here, else why not (for the launcher's
    "where" selector). An engine that fails to load says so instead of raising."""
    out: Dict[str, Optional[str]] = {}
    for name in engine_targets():
        try:
            cls = load_engine(name)
            out[name] = None if cls is None else cls.unusable()
        except Exception as err:  # noqa: BLE001 -- a broken third-party engine is listed, not fatal
            out[name] = f"it failed to load: {type(err).__name__}: {err}"
    return out


def group_options() -> tuple:
    """The keyword options every group takes (:class:`~nbdist.runtime.group.Group`'s)."""
    from .group import Group

    return tuple(p for p in inspect.signature(Group.__init__).parameters
                 if p not in ("self", "world_size", "_launcher"))


def start_on(on: str, world_size: int, backend, device, timeout, options: Dict[str, Any]):
    """A group whose ranks the engine ``on`` places; options split between engine and group."""
    from .group import Group

    from .handles import keep_alive_seconds

    cls = load_engine(on)
    common = group_options()
    unknown = sorted(k for k in options if k not in cls.options and k not in common
                     and k not in ENGINE_OPTIONS)
    if unknown:
        raise TypeError(f"start(on={on!r}) got {', '.join(repr(k) for k in unknown)}, which it "
                        f"does not take; {on!r} takes {', '.join(cls.options)}, every engine "
                        f"takes {', '.join(ENGINE_OPTIONS)}, and every group takes "
                        f"{', '.join(common)}.")
    keep_alive = keep_alive_seconds(options.pop("keep_alive", None))
    mine = {k: options.pop(k) for k in list(options) if k in cls.options}
    if keep_alive and "keep_alive" in cls.options:  # an engine that plans with it (k8s's deadline)
        mine["keep_alive"] = keep_alive
    launcher = cls().launcher(world_size, **mine)  # checks the options: nothing submitted yet
    why = cls.unusable()
    if why:
        raise ValueError(f"the engine {on!r} cannot run here: {why}.")
    launcher.engine = on
    if keep_alive:
        if not hasattr(launcher, "keep_alive"):
            raise ValueError(f"keep_alive: the engine {on!r} places its ranks with a launcher "
                             "that cannot keep them past this kernel (it is not an "
                             "AttachLauncher); drop keep_alive.")
        # (Engine is a layer above: its own reattach, not overridden, is known by its name)
        if getattr(cls.reattach, "__qualname__", "") == "Engine.reattach":
            raise ValueError(f"keep_alive: the engine {on!r} cannot take its ranks back in a new "
                             "kernel (it has no reattach), so they could not outlive this one; "
                             "drop keep_alive.")
        launcher.keep_alive = keep_alive
    try:
        return Group(world_size, backend, device, timeout, _launcher=launcher, **options)
    except BaseException:
        launcher.close()
        raise


def reattach(job: Optional[str] = None, *, join_timeout: float = 30.0, progress: bool = True,
             **options):
    """The group a kernel that is gone started with ``keep_alive``, its ranks reconnected (the
    handle ``job``'s, default the newest: :mod:`.handles`). :class:`NbdistError` saying what to do
    when there is no handle, or when its job has ended (the handle is then removed)."""
    from . import handles
    from .group import Group

    path, handle = handles.load(job)
    cls = load_engine(handle["engine"])
    cannot = NbdistError(f"reattach(): the engine {handle['engine']!r} of {path} cannot reattach "
                         "(it does not implement Engine.reattach and Engine.ended). Remove that "
                         "handle and start a new group.")
    if cls is None or not hasattr(cls, "reattach") or not hasattr(cls, "ended"):
        raise cannot
    ended = cls.ended(handle)
    if ended:
        handles.remove(path)
        raise NbdistError(f"reattach(): the saved group's job has ended ({ended}); its ranks and "
                          f"their variables are gone (handle {path} removed). Start a new group, "
                          f"e.g. nbdist.start({handle.get('world_size', 2)}, "
                          f"on={handle['engine']!r}, keep_alive='30m').")
    try:
        launcher = cls().reattach(handle, join_timeout=join_timeout, progress=progress)
    except NotImplementedError:  # Engine's own: the engine did not say how
        raise cannot from None
    launcher.engine, launcher.keep_alive = handle["engine"], float(handle["keep_alive"])
    launcher.reattach_key = bytes.fromhex(handle["key"])
    launcher.handle_path = path
    # a reattach that fails leaves the job and the handle alone (the ranks wait on)
    return Group(int(handle["world_size"]), "auto", "auto", float(handle.get("timeout", 60.0)),
                 _launcher=launcher, **options)
