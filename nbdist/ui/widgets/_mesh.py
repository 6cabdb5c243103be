"""The mesh panel: a world size and the sizes of ``pp``, ``dp`` (or ``dp_replicate`` x
``dp_shard``) and ``tp`` -> whether they fit, and the picture of the mesh (which rank sits where,
the groups along each dimension), with the valid layouts for the world size one click away.

Nothing runs on a group: it is :class:`nbdist.parallel.MeshLayout` (the layout torch's
``init_device_mesh`` builds) drawn with :func:`nbdist.ui.plots.mesh.plot_mesh`.
"""
from __future__ import annotations

import base64
import html
from typing import Dict, List, Optional

import ipywidgets as widgets
from traitlets import Instance, Int, TraitError, observe, validate

from ...parallel import DIMS, MeshLayout, factorizations
from ...parallel.layout import _positive
from ...runtime.group import current_group
from ..plots.mesh import plot_mesh
from ..plots.style import WIDTH
from ._common import Panel, figure_png, image

_OUT = "-"  # the dropdowns' value for a dimension left out of the mesh (the trait's None)
_SHOWN = 24  # valid layouts offered as buttons


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class MeshPanel(Panel):
    """Sizes -> the mesh: ``MeshPanel(4, dp=2, tp=2)``.

    Every size is a trait: ``None`` leaves the dimension out, ``-1`` takes the ranks the others
    leave, as in :class:`nbdist.parallel.MeshLayout`. Whenever the world size or a size changes
    the panel checks them with ``MeshLayout`` itself: a fit shows a green line ("valid: 4 ranks =
    dp 2 x tp 2"), the mesh as an HTML grid and a figure, and sets ``layout``; a misfit shows
    MeshLayout's error (with the valid factorizations) in red, keeps it in ``error`` and sets
    ``layout`` to ``None``. The valid layouts for the world size are buttons that set the sizes
    (:meth:`choose`). Size-1 dimensions are left out of the picture.
    """

    world_size = Int(4, min=1, help="number of ranks")
    pp = Int(None, allow_none=True, help="pipeline stages (None: no pp dimension)")
    dp = Int(None, allow_none=True, help="data-parallel size (None: no dp dimension)")
    dp_replicate = Int(None, allow_none=True, help="HSDP replicas (with dp_shard, not dp)")
    dp_shard = Int(None, allow_none=True, help="HSDP shard-group size (with dp_replicate)")
    tp = Int(None, allow_none=True, help="tensor-parallel size (None: no tp dimension)")
    layout = Instance(MeshLayout, allow_none=True, help="the mesh, or None when the sizes misfit")

    def __init__(self, world_size: Optional[int] = None, *, pp: Optional[int] = None,
                 dp: Optional[int] = None, dp_replicate: Optional[int] = None,
                 dp_shard: Optional[int] = None, tp: Optional[int] = None):
        super().__init__()
        self.add_class("nbdist-mesh")
        self._holding = True
        self._shown_for = None
        if world_size is None:  # the current group's, else 4
            group = current_group()
            world_size = group.world_size if group is not None and group.state != "stopped" \
                else 4
        self.world_size = world_size
        given = dict(pp=pp, dp=dp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
        if all(v is None for v in given.values()):  # dp x tp, as fsdp2+tp would build it
            from ...strategies import mesh_sizes

            given.update(mesh_sizes("fsdp2+tp", self.world_size))
        for name, value in given.items():
            setattr(self, name, value)

        wide = {"description_width": "initial"}
        self._world = widgets.BoundedIntText(self.world_size, min=1, max=4096,
                                             description="world size", style=wide,
                                             layout=widgets.Layout(width="150px"))
        self._world.add_class("nbdist-world-size")
        self._world.observe(lambda change: setattr(self, "world_size", change["new"]), "value")
        self._controls: Dict[str, widgets.Dropdown] = {}
        for dim in DIMS:
            control = widgets.Dropdown(description=dim, style=wide,
                                       layout=widgets.Layout(width="190px"))
            control.add_class(f"nbdist-{dim.replace('_', '-')}")
            self._controls[dim] = control
            self._bind_size(control, dim)
        self._validity = widgets.HTML()
        self._validity.add_class("nbdist-validity")
        self._table = widgets.HTML()
        self._table.add_class("nbdist-mesh-table")
        self.figure = image()
        self._layouts = widgets.HBox(layout=widgets.Layout(flex_flow="row wrap"))
        self._layouts.add_class("nbdist-valid-layouts")
        c = self._controls
        self.children = [
            widgets.HTML("<b>nbdist device mesh</b> (sizes -> layout; - leaves a dimension "
                         "out, rest (-1) takes the ranks left over)"),
            widgets.HBox([self._world, c["pp"], c["dp"], c["tp"]]),
            widgets.HBox([widgets.HTML("<span style='font-size:smaller;color:#444'>or HSDP "
                                       "instead of dp:</span>"),
                          c["dp_replicate"], c["dp_shard"]]),
            self._validity,
            self._feedback,
            self._table,
            self.figure,
            widgets.HTML("<span style='font-size:smaller'>valid layouts for this world size "
                         "(click one):</span>"),
            self._layouts,
        ]
        self._holding = False
        self._update()

    # ---- the sizes ----------------------------------------------------------------------------
    @validate(*DIMS)
    def _check_size(self, proposal):
        value = proposal["value"]
        if value is not None:
            try:
                _positive(proposal["trait"].name, value)
            except ValueError as err:
                raise TraitError(str(err)) from None
        return value

    @property
    def sizes(self) -> Dict[str, int]:
        """The sizes given, by dimension (left-out ones omitted), outermost first."""
        return {d: getattr(self, d) for d in DIMS if getattr(self, d) is not None}

    def choose(self, sizes: Dict[str, int]) -> None:
        """Set every size at once (dimensions not in ``sizes`` are left out), redraw once."""
        unknown = sorted(set(sizes) - set(DIMS))
        if unknown:
            raise ValueError(f"unknown mesh dimension {unknown[0]!r}; nbdist's mesh dimensions "
                             f"are {', '.join(DIMS)}")
        self._holding = True
        try:
            for dim in DIMS:
                setattr(self, dim, sizes.get(dim))
        finally:
            self._holding = False
        self._update()

    def _bind_size(self, control: widgets.Dropdown, dim: str) -> None:
        def to_trait(change):
            value = None if change["new"] == _OUT else change["new"]
            if dim not in self._quiet and getattr(self, dim) != value:
                setattr(self, dim, value)

        control.observe(to_trait, "value")

    @observe("world_size", *DIMS)
    def _changed(self, change) -> None:
        if not self._holding:
            self._update()

    # ---- drawing ------------------------------------------------------------------------------
    def _update(self) -> None:
        """Check the sizes with MeshLayout; redraw the controls, the validity line, the picture
        and the valid layouts."""
        self._world.value = self.world_size
        for dim, control in self._controls.items():
            value = getattr(self, dim)
            values = sorted(set(_divisors(self.world_size)) | ({value} - {None, -1}))
            options = [("-", _OUT), ("rest (-1)", -1)] + [(str(v), v) for v in values]
            self._quiet.add(dim)
            try:
                control.options = options
                control.value = _OUT if value is None else value
            finally:
                self._quiet.discard(dim)
        self._show_layouts()
        try:
            layout = MeshLayout(self.world_size, **self.sizes)
        except ValueError as err:
            self.layout = None
            self.error = str(err)
            self._validity.value = ("<span style='color:#b00020' data-valid='false'>not "
                                    "valid:</span>")
            self._table.value, self.figure.value = "", b""
            return
        self.error = ""
        self.layout = layout
        shown = {d: s for d, s in layout.sizes.items() if s > 1} or {layout.names[-1]: 1}
        drawn = MeshLayout(self.world_size, **shown)
        self._validity.value = (f"<span style='color:#1b7f3b' data-valid='true'>valid: "
                                f"{html.escape(self._product())}</span>")
        self._table.value = drawn._repr_html_()
        grids = len(drawn.grid())
        rows, cols = len(drawn.grid()[0][1]), len(drawn.grid()[0][1][0])
        col_dim = drawn.names[-1]  # long column labels (dp_shard=1) need wider boxes
        scale = max(1.0, len(f"{col_dim}={drawn.sizes[col_dim] - 1}") / 7)
        width = max(3.0, grids * (cols + 0.8) * 0.9 * scale + 1.0)
        height = (1.2 + rows * 0.75) * scale + 0.25 * len(drawn.sizes)
        self.figure.value = figure_png(lambda ax: plot_mesh(drawn, ax=ax),
                                       (min(width, WIDTH), height))

    # ---- a page without the widget ------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        """The widget, with what it shows now as text and static HTML: a page that cannot run
        the widget (a saved notebook on GitHub or nbviewer, an export without widget state)
        shows the mesh as it was instead of an empty output or a repr of the children."""
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            state = f"valid: {self._product()}" if self.layout is not None else \
                f"not valid: {self.error}"
            data["text/plain"] = f"nbdist mesh panel ({self.world_size} ranks): {state}"
            figure = base64.b64encode(self.figure.value).decode("ascii") \
                if self.figure.value else ""
            data["text/html"] = (
                f"<div class='nbdist-mesh-static'>{self._validity.value}{self._feedback.value}"
                f"{self._table.value}"
                + (f"<img src='data:image/png;base64,{figure}' alt='the mesh'>" if figure
                   else "")
                + "<div style='font-size:smaller;color:#555'>(the panel's controls need a "
                  "running kernel)</div></div>")
        return data

    def _product(self) -> str:
        sizes = " x ".join(f"{d} {s}" for d, s in self.layout.sizes.items())
        return f"{self.world_size} ranks = {sizes}"

    def _show_layouts(self) -> None:
        hsdp = self.dp_replicate is not None or self.dp_shard is not None
        dims = ("pp", "dp_replicate", "dp_shard", "tp") if hsdp else ("pp", "dp", "tp")
        if self._shown_for == (self.world_size, dims):
            return
        self._shown_for = (self.world_size, dims)
        valid = factorizations(self.world_size, dims)
        buttons = []
        for sizes in valid[:_SHOWN]:
            text = " x ".join(f"{d} {s}" for d, s in sizes.items())
            button = widgets.Button(description=text, tooltip=f"use {text}",
                                    layout=widgets.Layout(width="auto"))
            button.add_class("nbdist-layout")
            button.on_click(lambda _, s=sizes: self.choose(s))
            buttons.append(button)
        for old in self._layouts.children:
            old.close()
        self._layouts.children = buttons


__all__ = ["MeshPanel"]
