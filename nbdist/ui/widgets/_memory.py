"""The memory panel: model size (or a model factory from the notebook), strategies, precision and
optimizer; Run measures per-rank memory on the group (stacked bars with the ZeRO estimate); a
world-size slider redraws the analytic estimate at once, without touching the group."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import ipywidgets as widgets
from traitlets import Instance, Int, List, TraitError, Unicode, observe, validate

from ... import memory
from ...runtime.group import Group
from ._common import Panel, figure_png, image

_WORLD_SIZES = [2 ** i for i in range(13)]  # 1 .. 4096, the slider's stops


class MemoryPanel(Panel):
    """Per-rank memory of data-parallel strategies: measured on a group and estimated.

    ``model`` is ``"mlp:LAYERSxWIDTH"`` (measured and estimated) or a parameter count such as
    ``"7.5B"`` (estimated only); ``model_fn=`` takes a model factory from the notebook instead.
    Run calls :func:`nbdist.memory.measure` once per strategy (the progress bar moves per
    strategy) and keeps the result in ``panel.report``. Moving the world-size slider redraws
    :func:`nbdist.memory.estimate` for that many ranks at once; measured points are marked.
    """

    model = Unicode("mlp:4x1024", help="'mlp:LAYERSxWIDTH' or a parameter count such as '7.5B'")
    strategies = List(Unicode(), default_value=["ddp", "zero1", "fsdp"],
                      help="registered strategy names (nbdist.strategies)")
    precision = Unicode("fp32", help="'fp32' or 'bf16-mixed'")
    optimizer = Unicode("adam", help="'adam', 'adamw', 'momentum' or 'sgd'")
    world_size = Int(2, min=1, help="the world size the analytic estimate is drawn for")
    num_params = Int(0, help="Ψ, the model's parameter count (derived from model / model_fn)")
    report = Instance(memory.MemoryReport, allow_none=True, help="the last measurement")

    def __init__(self, group: Optional[Group] = None, model: str = "mlp:4x1024",
                 model_fn: Optional[Callable] = None,
                 strategies: Sequence[str] = ("ddp", "zero1", "fsdp"), precision: str = "fp32",
                 optimizer: str = "adam", world_size: Optional[int] = None):
        from ...strategies import PRECISIONS, available_strategies

        super().__init__(group)
        self.add_class("nbdist-memory")
        self.model_fn = model_fn
        if model_fn is None:
            self.model = model
        self.num_params = _count(model_fn or memory.model_spec(self.model))
        self.strategies, self.precision, self.optimizer = list(strategies), precision, optimizer
        self.world_size = world_size or (group.world_size if group is not None else 2)
        wide = {"description_width": "initial"}
        names = available_strategies()
        self._controls = {
            "model": widgets.Text(self.model, description="model", style=wide,
                                  continuous_update=False, layout=widgets.Layout(width="260px")),
            "precision": widgets.Dropdown(options=list(PRECISIONS), value=self.precision,
                                          description="precision", style=wide,
                                          layout=widgets.Layout(width="200px")),
            "optimizer": widgets.Dropdown(options=list(memory.OPTIMIZERS), value=self.optimizer,
                                          description="optimizer", style=wide,
                                          layout=widgets.Layout(width="180px")),
            "strategies": widgets.SelectMultiple(
                options=[(f"{n} — {d if len(d) < 64 else d[:63] + '…'}", n)
                         for n, d in names.items()],
                value=tuple(self.strategies), rows=min(8, len(names)), description="strategies",
                style=wide, layout=widgets.Layout(width="640px")),
            "world_size": widgets.SelectionSlider(
                options=self._stops(self.world_size), value=self.world_size,
                description="world size N (estimate)", style=wide, continuous_update=False,
                layout=widgets.Layout(width="520px")),
        }
        if model_fn is not None:
            self._controls["model"].value = f"model_fn: {getattr(model_fn, '__name__', 'model')}"
            self._controls["model"].disabled = True
        for name, control in self._controls.items():
            control.add_class(f"nbdist-{name.replace('_', '-')}")
            if not (name == "model" and model_fn is not None):
                self.bind(control, name)
        self.run_button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.run_button.add_class("nbdist-run")
        self.run_button.on_click(lambda _: self.action("measuring", self.run))
        self.progress = widgets.IntProgress(value=0, min=0, max=1,
                                            layout=widgets.Layout(width="420px"))
        self.progress.add_class("nbdist-progress")
        self._estimate_table, self._report_table = widgets.HTML(), widgets.HTML()
        self._estimate_table.add_class("nbdist-estimate")
        self._report_table.add_class("nbdist-report")
        self._estimate_figure, self._bars = image(), image()
        self._estimate_figure.add_class("nbdist-estimate-figure")
        self._bars.add_class("nbdist-bars")
        c = self._controls
        self.children = [
            widgets.HTML("<b>nbdist memory per rank</b>"),
            widgets.HBox([c["model"], c["precision"], c["optimizer"]]),
            c["strategies"],
            widgets.HBox([self.run_button, self.progress]),
            self._feedback,
            self._bars,
            self._report_table,
            c["world_size"],
            self._estimate_figure,
            self._estimate_table,
        ]
        self._draw_estimate()

    # ---- validation ---------------------------------------------------------------------------
    @validate("model")
    def _check_model(self, proposal):
        try:
            memory.model_spec(proposal["value"])
        except ValueError as err:
            raise TraitError(str(err)) from None
        return proposal["value"].strip()

    @validate("strategies")
    def _check_strategies(self, proposal):
        from ...strategies import get_strategy

        names = list(proposal["value"])
        if not names:
            raise TraitError("choose at least one strategy, e.g. ddp and fsdp")
        try:
            for name in names:
                get_strategy(name)
        except ValueError as err:
            raise TraitError(str(err)) from None
        return names

    @validate("precision", "optimizer")
    def _check_precision(self, proposal):
        values = {"precision": self.precision, "optimizer": self.optimizer,
                  proposal["trait"].name: proposal["value"]}
        try:
            memory.estimate(1, 1, 0, values["precision"], values["optimizer"])
        except ValueError as err:
            raise TraitError(str(err)) from None
        return proposal["value"]

    @observe("model")
    def _model_changed(self, change) -> None:
        self.num_params = _count(memory.model_spec(self.model))

    @staticmethod
    def _stops(world_size: int):
        return sorted(set(_WORLD_SIZES) | {world_size})

    @observe("world_size")
    def _world_size_changed(self, change) -> None:
        control = getattr(self, "_controls", {}).get("world_size")
        if control is not None and change["new"] not in control.options:
            control.options = self._stops(change["new"])

    # ---- actions ------------------------------------------------------------------------------
    def _factory(self) -> Callable:
        if self.model_fn is not None:
            return self.model_fn
        spec = memory.model_spec(self.model)
        if isinstance(spec, int):
            raise ValueError(f"the model {self.model!r} is a parameter count: it can be estimated "
                             "(the slider below), not measured. Enter mlp:LAYERSxWIDTH, or pass "
                             "model_fn= (a function that builds your model) to measure it.")
        return spec

    def run(self) -> str:
        """Measure every chosen strategy on the group (one after the other)."""
        factory = self._factory()
        group = self.group
        self.progress.max, self.progress.value, self.progress.bar_style = len(self.strategies), \
            0, "info"
        report = memory.MemoryReport()
        for name in self.strategies:
            self.progress.description = name
            report.extend(memory.measure(group, factory, [name], optimizer=self.optimizer,
                                         precision=self.precision))
            self.progress.value += 1
        self.progress.bar_style, self.progress.description = "success", "done"
        self.report = report
        self.world_size = group.world_size
        return f"measured {len(self.strategies)} strategies on {group.world_size} ranks"

    @observe("report")
    def _draw_report(self, change) -> None:
        report = self.report
        if not report:
            self._bars.value, self._report_table.value = b"", ""
            return
        from ..plots.style import WIDTH

        self._bars.value = figure_png(lambda ax: report.plot(ax=ax), (WIDTH, 4.0))
        self._report_table.value = _html(report._repr_html_())
        self._draw_estimate()

    @observe("model", "strategies", "precision", "optimizer", "world_size", "num_params")
    def _redraw(self, change) -> None:
        if hasattr(self, "_controls"):
            self._draw_estimate()

    def _draw_estimate(self) -> None:
        from ..plots.style import WIDTH

        args = (self.num_params, self.world_size, self.strategies, self.precision, self.optimizer)
        table = _html(memory.estimate_table(*args)._repr_html_())  # first: it raises on bad input
        self._estimate_figure.value = figure_png(
            lambda ax: memory.estimate_curve(self.num_params, self.strategies,
                                             precision=self.precision, optimizer=self.optimizer
                                             ).plot(ax=ax, mark=self.world_size,
                                                    measured=self.report),
            (WIDTH, 3.8))
        self._estimate_table.value = table  # after the figure: the table showing N means both do


def _html(table: str) -> str:
    return f"<div style='font-size:smaller;overflow-x:auto'>{table}</div>"


def _count(model_fn) -> int:
    """Ψ of the model ``model_fn()`` builds, built on the meta device (no memory) where it can be;
    a parameter count is returned as it is."""
    import torch

    if isinstance(model_fn, int):
        return model_fn
    try:
        with torch.device("meta"):
            return memory.count_params(model_fn())
    except (RuntimeError, NotImplementedError, TypeError):
        return memory.count_params(model_fn())  # factories that move data need a real build
