"""The notebook layer: magics, widgets and plots on top of nbdist's core API.

The only part of nbdist that imports IPython, ipywidgets or matplotlib. It may import every layer
below it; nothing imports it back, except a record's ``.plot()`` loading :mod:`nbdist.ui.plots`
when called (the plots take everything they draw from their arguments).

``nbdist.ui.launcher()``, ``bench_panel(group)``, ``memory_panel(group)``, ``mesh_panel()`` (a
device mesh from its sizes) and ``watch(job)`` (the live view of a background job) import ipywidgets only when first used; the plots live in
:mod:`nbdist.ui.plots`.
"""

_PANELS = ("launcher", "bench_panel", "memory_panel", "mesh_panel", "Launcher", "BenchPanel",
           "MemoryPanel", "MeshPanel")
_PACKAGES = ("live", "magics", "plots", "widgets")

__all__ = sorted(_PANELS + ("Watch", "watch"))


def __dir__():
    return sorted(set(__all__) | set(_PACKAGES))


def __getattr__(name):
    """``nbdist.ui.launcher()`` & co., importing ipywidgets only when first used."""
    if name in _PANELS:
        from . import widgets

        return getattr(widgets, name)
    if name in ("watch", "Watch"):
        from . import live

        return getattr(live, name)
    raise AttributeError(f"module 'nbdist.ui' has no attribute {name!r}")
