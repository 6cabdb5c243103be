"""Plots of per-rank memory: measured stacked bars with the ZeRO estimate, and the estimate against
world size. Each function takes data and ``ax=None`` and returns the Axes it drew on."""
from __future__ import annotations

from typing import Iterable, Optional

from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from ...report.table import KINDS, unit_of
from ...report.units import unit_for
from . import style

_STATE = ("params", "grads", "optimizer", "model_state", "estimate", "sharded", "replicated")
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "other": "#8172B3"}


@style.styled
def plot_memory(records: Iterable, ax=None):
    """Stacked bars (params / grads / optimizer / other) per strategy and rank.

    ``records``: a :class:`nbdist.memory.MemoryReport` or any iterable of
    :class:`nbdist.memory.MemoryRecord`. The ZeRO estimate of each record is a black dash across its
    bar; bars are grouped by strategy, one per rank. The unit is the memory table's (the
    largest binary unit in which every non-zero model-state figure is at least 1), so the axis
    reads as the table does. The legend sits right of the bars (it covers none); where the names would run into each
    other, every other one sits a line lower, none is broken.
    """
    records = list(records)
    if not records:
        raise ValueError("plot_memory() needs at least one MemoryRecord "
                         "(from nbdist.memory.measure)")
    unit_name = unit_of("bytes", [getattr(r, k) for r in records for k in _STATE]) or "B"
    unit = dict(KINDS["bytes"])[unit_name]
    strategies = list(dict.fromkeys(r.strategy for r in records))
    if ax is None:
        _, ax = style.new_figure(4.2)
    x, ticks, pos, spans = 0.0, [], [], set()
    marked = labelled = False
    for name in strategies:
        group = [r for r in records if r.strategy == name]
        centres = []
        for r in group:
            bottom = 0.0
            for part, color in COLORS.items():
                value = getattr(r, part) / unit
                ax.bar(x, value, 0.8, bottom=bottom, color=color,
                       label=None if labelled else part)
                bottom += value
            labelled = True
            if r.estimate:
                ax.hlines(r.estimate / unit, x - 0.45, x + 0.45, colors="black", linewidth=2,
                          label=None if marked else "ZeRO estimate")
                marked = True
            centres.append(x)
            x += 1.0
        pos.append(sum(centres) / len(centres))
        ticks.append(name)
        spans.add(f"ranks {group[0].rank}-{group[-1].rank}" if len(group) > 1
                  else f"rank {group[0].rank}")
        x += 0.6
    if len(spans) > 1:  # the strategies ran on different ranks: each label says which
        ticks = [f"{t} ({s})" for t, s in zip(ticks, [
            f"ranks {g[0].rank}-{g[-1].rank}" if len(g) > 1 else f"rank {g[0].rank}"
            for g in ([r for r in records if r.strategy == n] for n in strategies)])]
    top = max(max(r.model_state + r.other, r.estimate or 0) for r in records) / unit
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(pos)
    ax.set_xticklabels(ticks)
    if len(spans) == 1:
        ax.set_xlabel(f"one bar per rank ({spans.pop()})")
    ax.set_ylabel(f"bytes per rank ({unit_name})")
    ws = {r.world_size for r in records}
    ax.set_title(f"memory per rank (world size {', '.join(map(str, sorted(ws)))})")
    style.legend_outside(ax, reverse=True)  # top to bottom, as the segments stack
    _stagger_if_crowded(ax)
    return ax


def _stagger_if_crowded(ax, gap: float = 4.0) -> bool:
    """Every other tick label a line lower, each whole (a name broken at its "_" reads as two
    words), when labels side by side would come within ``gap`` pixels of each other as drawn;
    names that fit stay on one line. Returns whether it staggered."""
    ax.figure.canvas.draw()  # the layout as it will be shown: the labels' real extents
    labels = ax.xaxis.get_ticklabels()
    boxes = [label.get_window_extent() for label in labels]
    if not any(a.x1 + gap > b.x0 for a, b in zip(boxes, boxes[1:])):
        return False
    for tick in ax.xaxis.get_major_ticks()[1::2]:
        tick.set_pad(tick.get_pad() + 1.3 * labels[0].get_fontsize())
    return True


@style.styled
def plot_estimate(curve, ax=None, mark: Optional[int] = None, measured: Optional[Iterable] = None):
    """Per-rank model-state bytes against world size, from an estimate curve.

    ``curve``: what :func:`nbdist.memory.estimate_curve` returns (``curve.plot()`` calls this).
    ``mark`` draws a vertical line at one world size (the one you plan for); ``measured``
    (MemoryRecords) adds the measured model state of each strategy and world size as crosses in the
    strategy's colour.
    """
    if not hasattr(curve, "totals"):
        raise TypeError("plot_estimate() draws an estimate curve: build it with "
                        "nbdist.memory.estimate_curve(num_params, strategies, ...), then call its "
                        f".plot() (got {type(curve).__name__})")
    sizes = list(curve.world_sizes)
    if ax is None:
        _, ax = style.new_figure(4.2)
    unit, unit_name = unit_for(max(max(v) for v in curve.totals.values()))
    points = {}
    for r in measured or ():
        points.setdefault((r.strategy, r.world_size), []).append(r.model_state / unit)
    for name, values in curve.totals.items():
        (line,) = ax.plot(sizes, [v / unit for v in values], marker="o", markersize=3, label=name)
        mine = [(n, sum(v) / len(v)) for (s, n), v in sorted(points.items()) if s == name]
        if mine:
            ax.plot(*zip(*mine), linestyle="none", marker="x", markersize=9,
                    color=line.get_color(), label=f"{name} measured")
    if mark is not None:
        ax.axvline(mark, color="gray", linestyle=":", label=f"N = {mark}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 64, not 2^6
    ax.set_yscale("log")
    # Ticks at 1, 2 and 5 per decade, so a range inside one decade still has labels.
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("world size N (ranks)")
    # decimal units, as the ZeRO paper writes its figures; the label says so next to binary tables
    power = {"KB": "10³", "MB": "10⁶", "GB": "10⁹", "TB": "10¹²"}.get(unit_name)
    ax.set_ylabel(f"model state per rank ({unit_name}"
                  + (f" = {power} B)" if power else ")"))
    ax.set_title(f"ZeRO estimate, Ψ = {curve.num_params:,}, {curve.precision} {curve.optimizer}")
    style.legend_outside(ax)
    return ax
