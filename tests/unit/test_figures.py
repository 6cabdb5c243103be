"""Every figure nbdist draws, at its default size with data shaped like the tutorials', is readable:
no two texts overlap, none leaves the figure, no legend covers plotted data, every numeric axis
names its unit, and it fits a notebook column. The check, :func:`layout_problems`, reads the drawn
figure's own bounding boxes."""
import re

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

from figure_data import (live_job, memory_report, mesh_layouts, pipeline_timeline,  # noqa: E402
                         sweep_records, trace)

import nbdist.memory  # noqa: E402
from nbdist.ui.plots import style  # noqa: E402

SLACK = 0.5  # px: boxes that share an edge touch, they do not overlap


def _name(t: Text) -> str:
    ax = t.axes
    where = f" in {ax.get_title()!r}" if ax is not None and ax.get_title() else ""
    return f"{t.get_text()!r}{where}"


def _overlap(a: Bbox, b: Bbox) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > SLACK
            and min(a.y1, b.y1) - max(a.y0, b.y0) > SLACK)


def _drawn_texts(fig, monkeypatch):
    """Draw ``fig`` and return its renderer and the Text artists actually drawn with their boxes
    (clipped where the text is clipped); tick labels beyond the axis limits are not drawn, so
    they do not count."""
    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    drawn = []
    original = Text.draw

    def recording(self, renderer):
        drawn.append(self)
        return original(self, renderer)

    with monkeypatch.context() as m:
        m.setattr(Text, "draw", recording)
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for t in dict.fromkeys(drawn):
        if not t.get_visible() or not t.get_text().strip():
            continue
        box = t.get_window_extent(renderer)
        clip = t.get_clip_box() if t.get_clip_on() else None
        if clip is not None:
            box = Bbox.intersection(box, clip)
            if box is None:
                continue
        out.append((t, box))
    return renderer, out


def _data_paths(ax):
    """Display-space paths of what the Axes plots: lines, bar patches, bar collections."""
    for line in ax.get_lines():
        if line.get_visible():
            yield line, line.get_transform().transform_path(line.get_path()), False
    for patch in ax.patches:
        if patch.get_visible():
            yield patch, patch.get_transform().transform_path(patch.get_path()), True
    for coll in ax.collections:
        if coll.get_visible() and isinstance(coll, (PolyCollection, LineCollection)):
            for path in coll.get_paths():
                yield coll, coll.get_transform().transform_path(path), True


def layout_problems(fig, monkeypatch):
    """What makes ``fig`` hard to read, as sentences: overlapping texts, texts outside the figure,
    legends over plotted data. Empty when the figure is clean."""
    renderer, texts = _drawn_texts(fig, monkeypatch)
    problems = []
    inside = fig.bbox.padded(1)
    for i, (a, box_a) in enumerate(texts):
        if not (inside.contains(box_a.x0, box_a.y0) and inside.contains(box_a.x1, box_a.y1)):
            problems.append(f"{_name(a)} leaves the figure (x {box_a.x0:.0f}..{box_a.x1:.0f}, "
                            f"y {box_a.y0:.0f}..{box_a.y1:.0f} in {fig.bbox.width:.0f} x "
                            f"{fig.bbox.height:.0f} px)")
        for b, box_b in texts[i + 1:]:
            if _overlap(box_a, box_b):
                problems.append(f"{_name(a)} overlaps {_name(b)}")
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            for artist, path, filled in _data_paths(ax):
                clipped = Bbox.intersection(path.get_extents(), ax.bbox)
                if clipped is not None and path.intersects_bbox(box, filled=filled) and \
                        _overlap(clipped, box):
                    label = artist.get_label()
                    what = label if label and not label.startswith("_") else \
                        f"a {type(artist).__name__} at x {clipped.x0:.0f}..{clipped.x1:.0f} px"
                    problems.append(f"the legend ({', '.join(t.get_text() for t in legend.texts)})"
                                    f" covers {what} in {ax.get_title()!r}")
                    break
    return problems


def _is_number(text: str) -> bool:
    try:
        float(text.replace("\u2212", "-"))  # matplotlib's minus sign
    except ValueError:
        return False
    return True


def axes_without_units(fig):
    """The axes whose tick labels are bare numbers and whose label names no unit, as
    ``"(s)"``, ``"(GB/s)"`` or ``"(ranks)"`` do; tick labels with units ("4 KiB") need none."""
    out = []
    for ax in fig.axes:
        if not ax.axison:
            continue
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            ticks = [t.get_text() for t in axis.get_ticklabels() if t.get_text()]
            if ticks and all(map(_is_number, ticks)) and \
                    not re.search(r"\(.+\)", axis.get_label_text()):
                out.append(f"{name} axis {axis.get_label_text()!r} of {ax.get_title()!r}")
    return out


def test_the_checker_sees_overlaps_spills_and_covered_data(monkeypatch):
    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    ax.bar([0, 1], [1, 1], label="bars")
    ax.legend(loc="center")
    ax.text(0.5, 0.5, "here", transform=ax.transAxes)
    ax.text(0.5, 0.5, "there", transform=ax.transAxes)
    ax.text(0.9, 0.5, "far too long to stay inside", transform=ax.transAxes)
    problems = layout_problems(fig, monkeypatch)
    assert "'here' overlaps 'there'" in problems
    assert any(p.startswith("'far too long to stay inside' leaves the figure") for p in problems)
    assert any(p.startswith("the legend (bars) covers") for p in problems)
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

    return Watch(live_job())._figure_bundle()


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


OWNED = pytest.mark.xfail(strict=True, reason="owned by the pipeline/live-view change")

FIGURES = {
    "collectives sweep (03)": lambda: sweep_records().plot(limit=12.0),
    "latency alone": lambda: sweep_records().plot("latency"),
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
}
OWNED_FIGURES = {  # fail today: the changes under way to these figures make them pass
    "pipeline interleaved (10)": _pipeline("interleaved1f1b"),
    "live view (08)": _saved(_live),
}


def _figure(drawn):
    while not hasattr(drawn, "savefig") and not hasattr(drawn, "figure"):
        drawn = list(drawn)[0]
    return drawn if hasattr(drawn, "savefig") else drawn.figure


def _check(draw, monkeypatch, tmp_path):
    fig = _figure(draw())
    try:
        fig.savefig(tmp_path / "figure.png")  # to look at: pytest --basetemp=/tmp/figures
        assert layout_problems(fig, monkeypatch) == []
        assert axes_without_units(fig) == []
        width, _ = fig.get_size_inches()
        assert width <= style.WIDTH + 0.01, "wider than a notebook column"
    finally:
        plt.close(fig)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(FIGURES))
def test_the_figure_is_readable(name, monkeypatch, tmp_path):
    _check(FIGURES[name], monkeypatch, tmp_path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [pytest.param(n, marks=OWNED) for n in OWNED_FIGURES])
def test_the_figure_owned_elsewhere_is_readable(name, monkeypatch, tmp_path):
    _check(OWNED_FIGURES[name], monkeypatch, tmp_path)


def test_many_panels_make_a_grid():
    assert style.grid(1) == (1, 1)
    assert style.grid(2) == (1, 2)
    assert style.grid(6) == (2, 3)
    assert style.grid(7) == (3, 3)
