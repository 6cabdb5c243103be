"""Every figure nbdist draws, at its default size with data shaped like the tutorials', is readable:
no two texts overlap, none leaves the figure, no legend covers plotted data, every numeric axis
names its unit, and it fits a notebook column. The check, :func:`layout_problems`, reads the drawn
figure's own bounding boxes."""
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from figure_checks import axes_without_units, layout_problems  # noqa: E402
from figure_data import (live_job, memory_report, mesh_layouts, pipeline_timeline,  # noqa: E402
                         sweep_records, trace)

import nbdist.memory  # noqa: E402
from nbdist.ui.plots import style  # noqa: E402

def test_the_checker_sees_overlaps_spills_and_covered_data():
    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.bar([0, 1], [1, 1], label="bars")
    ax.legend(loc="center")
    ax.text(0.5, 0.5, "here", transform=ax.transAxes)
    ax.text(0.5, 0.5, "there", transform=ax.transAxes)
    ax.text(0.9, 0.5, "far too long to stay inside", transform=ax.transAxes)
    problems = layout_problems(fig)
    assert "'here' overlaps 'there'" in problems
    assert any(p.startswith("'far too long to stay inside' leaves the figure") for p in problems)
    assert any(p.startswith("the legend (bars) covers") for p in problems)
    other = fig.add_axes((0.4, 0.4, 0.4, 0.3))  # a panel under the texts
    other.set_title("inset")
    assert "'here' reaches into the panel 'inset'" in layout_problems(fig)
    other.remove()
    ax.set_xlabel("time")
    assert axes_without_units(fig) == ["x axis 'time' of ''", "y axis '' of ''"]
    ax.set(xlabel="time (s)", ylabel="bandwidth (GB/s)")
    assert axes_without_units(fig) == []


def _pipeline(schedule):
    return lambda: pipeline_timeline(schedule).plot()


def _saved(draw):
    """The figure that ``draw()`` renders to PNG itself (the live view, the panels)."""
    def figure():
        figures = []
        original = Figure.savefig

        def keep(self, *args, **kwargs):
            figures.append(self)
            return original(self, *args, **kwargs)

        Figure.savefig = keep
        try:
            draw()
        finally:
            Figure.savefig = original
        return figures[-1]
    return figure


def _live():
    from nbdist.ui.live import Watch

    return Watch(live_job()).figure()


def _bench_panel():
    from nbdist.ui.widgets._common import figure_png

    return figure_png(lambda axes: sweep_records().plot(ax=axes), (style.WIDTH, 4.0), ncols=2)


def _memory_panel(part):
    """The memory panel's bars or estimate curve (07), drawn as the panel draws them."""
    from nbdist.ui.widgets._common import figure_png

    three = ("ddp", "zero1", "fsdp")
    if part == "bars":
        return lambda: figure_png(lambda ax: memory_report(2, strategies=three).plot(ax=ax),
                                  (style.WIDTH, 4.0))
    return lambda: figure_png(lambda ax: nbdist.memory.estimate_curve(1_050_624, list(three)).plot(
        ax=ax, mark=2, measured=memory_report(2, strategies=three)), (style.WIDTH, 3.8))


FIGURES = {
    "collectives sweep (03)": lambda: sweep_records().plot(limit=12.0),
    "latency alone": lambda: sweep_records().plot("latency"),
    "bus bandwidth alone, memcpy far above": lambda: sweep_records().plot("busbw", limit=200.0),
    "bus bandwidth alone, memcpy near": lambda: sweep_records().plot("busbw", limit=1.0),
    "collectives in the bench panel": _saved(_bench_panel),
    "memory bars in the memory panel (07)": _saved(_memory_panel("bars")),
    "estimate curve in the memory panel (07)": _saved(_memory_panel("estimate")),
    "comparison of world sizes (03)": lambda: sweep_records(world_sizes=(2, 3)).plot("busbw"),
    "trace timeline (03)": lambda: trace().plot(),
    "memory per rank, eight strategies (09)": lambda: memory_report().plot(),
    "memory per rank, four strategies on 4 ranks (04)": lambda: memory_report(
        4, strategies=("ddp", "zero1", "fsdp_grad_op", "fsdp")).plot(),
    "estimate curve (04)": lambda: nbdist.memory.estimate_curve(
        "7.5B", ["ddp", "zero1", "fsdp_grad_op", "fsdp"], precision="bf16-mixed").plot(mark=64),
    "estimate with measured points": lambda: nbdist.memory.estimate_curve(
        263_168, ["ddp", "zero1", "fsdp"], world_sizes=[1, 2, 4, 8]).plot(
        measured=memory_report()),
    "mesh dp x tp (10)": lambda: mesh_layouts()[0].plot(),
    "mesh pp x dp x tp": lambda: mesh_layouts()[1].plot(),
    "pipeline gpipe (10)": _pipeline("gpipe"),
    "pipeline interleaved (10)": _pipeline("interleaved1f1b"),
    "live view (08)": _live,
}


def _figure(drawn):
    while not hasattr(drawn, "savefig") and not hasattr(drawn, "figure"):
        drawn = list(drawn)[0]
    return drawn if hasattr(drawn, "savefig") else drawn.figure


def _check(draw, monkeypatch, tmp_path):
    fig = _figure(draw())
    try:
        fig.savefig(tmp_path / "figure.png")  # to look at: pytest --basetemp=/tmp/figures
        assert layout_problems(fig) == []
        assert axes_without_units(fig) == []
        width, _ = fig.get_size_inches()
        assert width <= style.WIDTH + 0.01, "wider than a notebook column"
    finally:
        plt.close(fig)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(FIGURES))
def test_the_figure_is_readable(name, monkeypatch, tmp_path):
    _check(FIGURES[name], monkeypatch, tmp_path)


def test_many_panels_make_a_grid():
    assert style.grid(1) == (1, 1)
    assert style.grid(2) == (1, 2)
    assert style.grid(6) == (2, 3)
    assert style.grid(7) == (3, 3)
