"""The notebook layer: magics, widgets and plots on top of nbdist's core API.

``nbdist.ui.launcher()``, ``bench_panel(group)`` and ``memory_panel(group)`` import ipywidgets only
when first used; the plots live in :mod:`nbdist.ui.plots`.
"""

_PANELS = ("launcher", "bench_panel", "memory_panel", "Launcher", "BenchPanel", "MemoryPanel")


def __getattr__(name):
    """``nbdist.ui.launcher()`` & co., importing ipywidgets only when first used."""
    if name in _PANELS:
        from . import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module 'nbdist.ui' has no attribute {name!r}")
