"""``%dist_ui``: show nbdist's panels (launcher, collective benchmark, memory, mesh) in the
notebook.

ipywidgets is imported only when the magic runs, so ``%load_ext nbdist`` works without it.
"""
from __future__ import annotations

from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .base import NbdistMagics, register_magics

PANELS = ("launcher", "bench", "memory", "mesh")
"""The panels ``%dist_ui`` shows, by name."""


@register_magics
@magics_class
class UIMagics(NbdistMagics):
    """``%dist_ui [launcher|bench|memory|mesh]``."""

    @line_magic
    @magic_arguments()
    @argument("panel", nargs="?", default="launcher", choices=PANELS,
              help="which panel: launcher (default), bench, memory or mesh")
    def dist_ui(self, line: str = ""):
        """Show a panel: the launcher (start / restart / stop the current group, live per-rank
        status), the collective benchmark, the memory view, or the device mesh (world size and
        pp / dp / tp sizes -> valid or not, which rank sits where; the valid layouts to click).

        The panels work on the current group, the one %%dist and nbdist.current_group() use.
        The panel is the cell's value: ui = %dist_ui keeps it, e.g. to set ui.world_size = 4.
        """
        args = self.parse(self.dist_ui, line)
        from .. import widgets

        if args.panel == "bench":
            return widgets.bench_panel()
        if args.panel == "memory":
            return widgets.memory_panel()
        if args.panel == "mesh":
            return widgets.mesh_panel()
        return widgets.launcher()
