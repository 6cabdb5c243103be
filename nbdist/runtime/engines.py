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

ENTRY_POINT_GROUP = "nbdist.engines"  #: where third-party engines register
#: the engines nbdist brings (``"local"``: this machine's forkserver/spawn workers, built in here)
BUILTIN = {"local": "", "slurm": "nbdist.engines.slurm:SlurmEngine",
           "ray": "nbdist.engines.ray:RayEngine"}


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

    cls = load_engine(on)
    common = group_options()
    unknown = sorted(k for k in options if k not in cls.options and k not in common)
    if unknown:
        raise TypeError(f"start(on={on!r}) got {', '.join(repr(k) for k in unknown)}, which it "
                        f"does not take; {on!r} takes {', '.join(cls.options)}, and every group "
                        f"takes {', '.join(common)}.")
    mine = {k: options.pop(k) for k in list(options) if k in cls.options}
    launcher = cls().launcher(world_size, **mine)  # checks the options: nothing submitted yet
    why = cls.unusable()
    if why:
        raise ValueError(f"the engine {on!r} cannot run here: {why}.")
    try:
        return Group(world_size, backend, device, timeout, _launcher=launcher, **options)
    except BaseException:
        launcher.close()
        raise
