"""``%dist_ui``: show nbdist's panels (launcher, collective benchmark, memory) in the notebook.

ipywidgets is imported only when the magic runs, so ``%load_ext nbdist`` works without it.
"""
from __future__ import annotations

from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from .base import NbdistMagics, register_magics

PANELS = ("launcher", "bench", "memory")
"""The panels ``%dist_ui`` shows, by name."""


@register_magics
@magics_class
class UIMagics(NbdistMagics):
    """``%dist_ui [launcher|bench|memory]``."""

    @line_magic
    @magic_arguments()
    @argument("panel", nargs="?", default="launcher", choices=PANELS,
              help="which panel: launcher (default), bench or memory")
    def dist_ui(self, line: str = ""):
        """Show a panel: the launcher (start / restart / stop the current group, live per-rank
        status), the collective benchmark or the memory view.

        The panels work on the current group, the one %%dist and nbdist.current_group() use.
        The panel is the cell's value: ui = %dist_ui keeps it, e.g. to set ui.world_size = 4.
        """
        args = self.parse(self.dist_ui, line)
        from .. import widgets

        if args.panel == "bench":
            return widgets.bench_panel()
        if args.panel == "memory":
            return widgets.memory_panel()
        return widgets.launcher()
