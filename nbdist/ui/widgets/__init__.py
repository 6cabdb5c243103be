"""ipywidgets panels for a group: a launcher, a collective benchmark, a memory view and a mesh.

    from nbdist.ui.widgets import launcher, bench_panel, memory_panel, mesh_panel
    launcher()           # world size, device, backend, strategy, timeout; Start / Restart / Stop
    bench_panel()        # ops, sizes, iterations; Run; Compare with another backend or world size
    memory_panel()       # model, strategies, precision; Run; a world-size slider for the estimate
    mesh_panel()         # world size, pp / dp (or dp_replicate x dp_shard) / tp -> valid? picture

``%dist_ui`` (``%dist_ui bench``, ``%dist_ui memory``, ``%dist_ui mesh``) shows the same panels.

The panels hold no logic of their own: their buttons call the public API (:func:`nbdist.start`,
``Group.restart``, :func:`nbdist.bench.collectives`, :func:`nbdist.memory.measure`...), their
options are traits validated with the API's own checks (a refused choice shows the reason in the
panel), and they work on the current group (:func:`nbdist.current_group`): the group the launcher
starts is the one ``%%dist`` and your code use. An error from a button is shown in red in the panel
that raised it, and kept in its ``error`` trait. Every panel can be driven from code: set its
traits, call ``panel.run()`` / ``launcher.start()``, or press ``panel.run_button.click()``.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from ...runtime.group import Group
from ._bench import BenchPanel
from ._common import Panel
from ._launcher import Launcher
from ._memory import MemoryPanel
from ._mesh import MeshPanel

__all__ = sorted(["BenchPanel", "Launcher", "MemoryPanel", "MeshPanel", "Panel", "bench_panel",
                  "launcher", "memory_panel", "mesh_panel"])


def launcher(world_size: Optional[int] = None, device: Optional[str] = None, backend: str = "auto",
             strategy: str = "ddp", timeout: float = 60.0,
             refresh_interval: float = 0.5) -> Launcher:
    """A :class:`Launcher` panel: Start / Restart / Stop the current group, with a status table
    refreshed every ``refresh_interval`` seconds. ``device`` defaults to cuda where there is one,
    ``world_size`` to one rank per GPU (two ranks on CPU). When a group is already running, the
    panel shows it and takes its options."""
    return Launcher(world_size, device, backend, strategy, timeout, refresh_interval)


def bench_panel(group: Optional[Group] = None, ops="all_reduce", sizes=("4K", "1M"),
                iters: int = 10) -> BenchPanel:
    """A :class:`BenchPanel` on ``group`` (default: the current group when Run is pressed)."""
    return BenchPanel(group, ops, sizes, iters)


def memory_panel(group: Optional[Group] = None, model: str = "mlp:4x1024",
                 model_fn: Optional[Callable] = None,
                 strategies: Sequence[str] = ("ddp", "zero1", "fsdp"), precision: str = "fp32",
                 optimizer: str = "adam", world_size: Optional[int] = None) -> MemoryPanel:
    """A :class:`MemoryPanel` on ``group`` (default: the current group when Run is pressed);
    ``model_fn`` measures a model factory from the notebook instead of ``model``."""
    return MemoryPanel(group, model, model_fn, strategies, precision, optimizer, world_size)


def mesh_panel(world_size: Optional[int] = None, *, pp: Optional[int] = None,
               dp: Optional[int] = None, dp_replicate: Optional[int] = None,
               dp_shard: Optional[int] = None, tp: Optional[int] = None) -> MeshPanel:
    """A :class:`MeshPanel`: sizes -> whether they fit ``world_size`` ranks (default: the
    current group's, else 4) and the picture of the mesh. With no size given it starts at the
    ``dp x tp`` mesh ``fsdp2+tp`` builds (:func:`nbdist.strategies.mesh_sizes`); ``None`` leaves
    a dimension out, ``-1`` takes the ranks left over."""
    return MeshPanel(world_size, pp=pp, dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard,
                     tp=tp)
