"""The benchmark panel: ops, size range and iterations; Run with a progress bar; the table and
the latency / bus-bandwidth plots below; Compare adds a run on another backend or world size."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import ipywidgets as widgets
from traitlets import Instance, Int, List, TraitError, Tuple as TTuple, Unicode, observe, validate

from ... import bench
from ...backends import resolve_backend, resolve_device
from ...bench import Records
from ...runtime.group import Group
from ._common import Panel, backend_options, figure_png, image, reasons_html

_SIZES = [2 ** i for i in range(31)]  # 1 B .. 1 GiB, the range slider's stops


class BenchPanel(Panel):
    """Benchmark collectives on a group (given, or the current group when a button is pressed).

    Run calls :func:`nbdist.bench.collectives` once per (op, size) point, so the progress bar
    moves point by point; the records are in ``panel.records`` (a :class:`nbdist.bench.Records`).
    Compare calls :func:`nbdist.bench.compare` with the chosen backend and world size (the group
    restarts for it and is put back as it was; per-rank variables are lost) and adds the records
    to the same table and figure.
    """

    ops = List(Unicode(), default_value=["all_reduce"], help="op names (nbdist.bench.OPS)")
    sizes = TTuple(default_value=(4096, 1 << 20),
                   help="smallest and largest message in bytes (powers of two)")
    iters = Int(10, min=1, help="measured iterations per point")
    compare_backend = Unicode("auto", help="backend of the run Compare adds")
    compare_world_size = Int(2, min=1, help="world size of the run Compare adds")
    records = Instance(Records, args=(), help="the records shown (Run replaces, Compare adds)")

    def __init__(self, group: Optional[Group] = None, ops: Union[str, Sequence[str]] = "all_reduce",
                 sizes: Tuple[Union[int, str], Union[int, str]] = ("4K", "1M"), iters: int = 10):
        super().__init__(group)
        self.add_class("nbdist-bench")
        self.ops, self.sizes, self.iters = bench.parse_ops(ops), sizes, iters
        self._device = group.device if group is not None else resolve_device("auto")
        backends, reasons = backend_options(self._device)
        if group is not None:
            self.compare_world_size = group.world_size
        wide = {"description_width": "initial"}
        self._controls = {
            "ops": widgets.SelectMultiple(options=list(bench.OPS), value=tuple(self.ops), rows=4,
                                          description="ops", style=wide),
            "sizes": widgets.SelectionRangeSlider(
                options=[(bench.format_bytes(s), s) for s in _SIZES], index=(0, 0),
                description="sizes", style=wide, continuous_update=False,
                layout=widgets.Layout(width="420px")),
            "iters": widgets.BoundedIntText(self.iters, min=1, max=100000, description="iterations",
                                            style=wide, layout=widgets.Layout(width="160px")),
            "compare_backend": widgets.Dropdown(options=backends, value=self.compare_backend,
                                                description="compare with backend", style=wide,
                                                layout=widgets.Layout(width="290px")),
            "compare_world_size": widgets.BoundedIntText(self.compare_world_size, min=1,
                                                         max=4096, description="world size",
                                                         style=wide,
                                                         layout=widgets.Layout(width="150px")),
        }
        self._controls["sizes"].value = self.sizes
        for name, control in self._controls.items():
            control.add_class(f"nbdist-{name.replace('_', '-')}")
            self.bind(control, name)
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.compare_button = widgets.Button(description="Compare", icon="plus")
        self.run_button.add_class("nbdist-run")
        self.compare_button.add_class("nbdist-compare")
        self.run_button.on_click(lambda _: self.action("running the benchmark", self.run))
        self.compare_button.on_click(lambda _: self.action("comparing", self.compare))
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="",
                                            layout=widgets.Layout(width="420px"))
        self.progress.add_class("nbdist-progress")
        self._table = widgets.HTML()
        self._table.add_class("nbdist-records")
        self._figure = image()
        c = self._controls
        self.children = [
            widgets.HTML("<b>nbdist collective benchmark</b>"),
            widgets.HBox([c["ops"], widgets.VBox([c["sizes"], c["iters"]])]),
            widgets.HBox([self.run_button, self.progress]),
            widgets.HBox([c["compare_backend"], c["compare_world_size"], self.compare_button]),
            widgets.HTML(reasons_html(reasons)),
            self._feedback,
            self._table,
            self._figure,
        ]

    # ---- validation ---------------------------------------------------------------------------
    @validate("ops")
    def _check_ops(self, proposal):
        try:
            return bench.parse_ops(list(proposal["value"]))
        except ValueError as err:
            raise TraitError(str(err)) from None

    @validate("sizes")
    def _check_sizes(self, proposal):
        try:
            lo, hi = (bench.parse_size(s) for s in proposal["value"])
        except (TypeError, ValueError) as err:
            raise TraitError(str(err)) from None
        odd = [s for s in (lo, hi) if s not in _SIZES]
        if odd or lo > hi:
            raise TraitError(f"sizes must be two powers of two from 1 B to 1 GiB, the smaller "
                             f"first (the sweep doubles from one to the other); got "
                             f"{tuple(proposal['value'])!r}")
        return lo, hi

    @validate("compare_backend")
    def _check_backend(self, proposal):
        try:
            resolve_backend(proposal["value"], self._device)
        except (ValueError, TypeError) as err:
            raise TraitError(str(err)) from None
        return proposal["value"]

    # ---- actions ------------------------------------------------------------------------------
    def _points(self):
        sizes = bench.parse_sizes(f"{self.sizes[0]}-{self.sizes[1]}")
        return [(op, size) for op in self.ops for size in (sizes[:1] if op == "barrier" else sizes)]

    def run(self) -> str:
        """Sweep the chosen ops and sizes on the group; the records replace those shown."""
        group = self.group
        points = self._points()
        self.progress.max, self.progress.value, self.progress.bar_style = len(points), 0, "info"
        out = Records()
        for op, size in points:
            self.progress.description = (op if op == "barrier"
                                         else f"{op} {bench.format_bytes(size)}")
            out.extend(bench.collectives(group, ops=[op], sizes=[size], iters=self.iters,
                                         progress=False))
            self.progress.value += 1
        self.progress.bar_style, self.progress.description = "success", "done"
        self.records = out
        return f"{len(out)} points on {group.backend}, {group.world_size} ranks"

    def compare(self) -> str:
        """Add a run with ``compare_backend`` and ``compare_world_size`` (and, when nothing was
        run yet, one as the group is) to the table and figure."""
        group = self.group
        config = {"backend": self.compare_backend, "world_size": self.compare_world_size}
        configs = [config] if self.records else [{}, config]
        self.progress.max, self.progress.value, self.progress.bar_style = 1, 0, "info"
        self.progress.description = "restarting…"
        new = bench.compare(group, configs, ops=self.ops,
                            sizes=f"{self.sizes[0]}-{self.sizes[1]}", iters=self.iters,
                            progress=False)
        self.progress.value, self.progress.bar_style, self.progress.description = 1, "success", \
            "done"
        self.records = Records(list(self.records) + list(new))
        return (f"added {len(new)} points; the group was restarted for the comparison and is "
                f"back to {group.backend}, {group.world_size} ranks (per-rank variables are lost)")

    @observe("records")
    def _draw(self, change) -> None:
        records = self.records
        if not records:
            self._table.value, self._figure.value = "", b""
            return
        self._table.value = ("<div style='max-height:32em;overflow:auto;font-size:smaller'>"
                             + records._repr_html_() + "</div>")
        from ..plots.style import WIDTH

        self._figure.value = figure_png(lambda axes: records.plot(ax=axes), (WIDTH, 4.0), ncols=2)
