"""ipywidgets panels for a group: a launcher, a collective benchmark and a memory view.

    from nbdist.ui.widgets import launcher, bench_panel, memory_panel
    launcher()           # world size, device, backend, strategy, timeout; Start / Restart / Stop
    bench_panel()        # ops, sizes, iterations; Run; Compare with another backend or world size
    memory_panel()       # model, strategies, precision; Run; a world-size slider for the estimate

``%dist_ui`` (``%dist_ui bench``, ``%dist_ui memory``) shows the same panels.

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

__all__ = sorted(["BenchPanel", "Launcher", "MemoryPanel", "Panel", "bench_panel", "launcher",
                  "memory_panel"])


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
