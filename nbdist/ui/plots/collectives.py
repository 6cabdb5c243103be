"""Plots of collective benchmarks (:class:`nbdist.bench.Records`) and traces
(:class:`nbdist.bench.Trace`). Each function takes the data and ``ax=None`` and returns the Axes it
drew on (:func:`plot_collectives`: its two Axes); none calls ``plt.show()``.

A line is drawn per op and configuration; its label names only what differs between the lines
(the op, and the backend / world size / device / dtype when the records mix several).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import matplotlib.pyplot as plt
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.ticker import (FixedLocator, FuncFormatter, LogLocator, NullFormatter,
                               NullLocator)

from ...report.units import format_bytes, format_rate, format_time
from . import style

_CONFIG = ("backend", "world_size", "device", "dtype")
_MARKERS = "os^vD<>p*h"


def _lines(records: Iterable[Dict[str, Any]], value: str):
    """Group ok records into lines: [(label, [(bytes, value, noisy)...], style index)]."""
    rows = [r for r in records if r.get("status") == "ok" and r.get(value) is not None]
    varying = [k for k in _CONFIG if len({r.get(k) for r in rows}) > 1]
    lines: Dict[Tuple, List[Tuple[float, float]]] = {}
    for r in rows:
        key = (r["op"],) + tuple(r.get(k) for k in varying)
        lines.setdefault(key, []).append((r["bytes"], r[value], bool(r.get("noisy"))))
    out = []
    for i, (key, points) in enumerate(lines.items()):
        parts = [key[0]] + [f"{k.replace('world_size', 'n')}={v}" if k == "world_size" else str(v)
                            for k, v in zip(varying, key[1:])]
        out.append((" ".join(parts), sorted(points), i))
    return out


def _draw(ax, points, i: int, label: str) -> List[float]:
    """One line; its noisy points (p90 > 2 x p10) drawn hollow, in the line's colour: on a
    busy machine most points can be noisy, and a mark on each must not bury the data. Returns
    its sizes."""
    xs, ys, bad = zip(*points)
    marker = _MARKERS[i % len(_MARKERS)]
    (line,) = ax.plot(xs, ys, marker=marker, markersize=4, label=label,
                      markevery=[k for k, b in enumerate(bad) if not b])
    hollow = [(x, y) for x, y, b in points if b]
    if hollow:
        ax.scatter(*zip(*hollow), s=20, marker=marker, facecolors="white",
                   edgecolors=line.get_color(), linewidths=1, zorder=3)
        if not any(c.get_label() == _NOISY for c in ax.collections):  # one legend entry
            ax.scatter([], [], s=20, marker="o", facecolors="white", edgecolors="0.35",
                       linewidths=1, label=_NOISY)
    return list(xs)


_NOISY = "hollow: noisy (p90 > 2× p10)"


def _legend(ax) -> None:
    """The legend outside the data, with the noisy-point entry last (after every line it may
    mark)."""
    if ax.child_axes:  # the "% of memcpy" axis takes the right side: the legend goes under
        style.legend_below(ax.figure, [ax], last=(_NOISY,))
    else:
        style.legend_outside(ax, last=(_NOISY,))


def _new_axes(ax):
    if ax is None:
        _, ax = style.new_figure(4.0)
    return ax


def _size_axis(ax, sizes: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    sizes = sorted(set(sizes))
    if sizes:
        step = max(1, (len(sizes) + 7) // 8)  # at most ~8 labelled ticks
        ax.xaxis.set_major_locator(FixedLocator(sizes[::step]))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


@style.styled
def plot_latency(records: Iterable[Dict[str, Any]], ax=None):
    """Time per op (median over iterations of the slowest rank) against message size, log-log.

    Barriers, which carry no data, are dashed horizontal lines. Noisy points (the record's
    ``noisy``: p90 > 2x p10) are drawn hollow, here and in :func:`plot_busbw`.
    """
    records = list(records)
    ax = _new_axes(ax)
    sizes = []
    for label, points, i in _lines((r for r in records if r["op"] != "barrier"), "time_s"):
        sizes += _draw(ax, points, i, label)
    for label, points, _ in _lines((r for r in records if r["op"] == "barrier"), "time_s"):
        ax.axhline(points[0][1], linestyle="--", color="gray", label=label)
    ax.set_yscale("log")
    # Ticks at 1, 2 and 5 per decade, so a range inside one decade still has labels.
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_time(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())
    _size_axis(ax, sizes)
    ax.set_ylabel("time per op (slowest rank, median)")
    ax.set_title("latency")
    _legend(ax)
    return ax


_ON_SCALE = 1.5  #: a limit up to this many times the highest point is drawn as a line


@style.styled
def plot_busbw(records: Iterable[Dict[str, Any]], ax=None, limit: Optional[float] = None,
               limit_label: str = "memcpy"):
    """Bus bandwidth (GB/s, nccl-tests' definition; from the median time) against message size.

    ``limit`` (GB/s), e.g. the machine's memcpy bandwidth from
    :func:`nbdist.bench.memcpy_bandwidth`, adds a right-hand axis in percent of it, and a
    dotted line at it when it is near the data. A limit far above every point is not drawn
    (it would squeeze the curves into the bottom of the plot); its legend entry gives the value
    and says it is off the scale.
    """
    ax = _new_axes(ax)
    sizes: List[float] = []
    top = 0.0
    for label, points, i in _lines(records, "busbw_GBps"):
        sizes += _draw(ax, points, i, label)
        top = max(top, *(y for _, y, _ in points))
    if limit is not None:
        text = f"{limit_label} ({format_rate(limit)})"
        if top and limit > _ON_SCALE * top:
            ax.plot([], [], linestyle=":", color="black", label=f"{text}: above the plot")
            ax.set_ylim(0, top * 1.1)
        else:
            ax.axhline(limit, linestyle=":", color="black", label=text)
        ax.secondary_yaxis("right", functions=(lambda v: v / limit * 100,
                                               lambda p: p * limit / 100)
                           ).set_ylabel(f"% of {limit_label}")
    _size_axis(ax, sizes)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("bus bandwidth")
    _legend(ax)
    return ax


@style.styled
def plot_collectives(records: Iterable[Dict[str, Any]], ax=None, limit: Optional[float] = None,
                     limit_label: str = "memcpy"):
    """Latency and bus bandwidth side by side; return the two Axes.

    ``ax``: two existing Axes to draw into (default: a new figure). In a figure with constrained
    layout (the default one) a single legend goes under both panels.
    """
    records = list(records)
    if ax is None:
        _, ax = style.new_figure(4.0, 1, 2)
    if len(ax) != 2:
        raise ValueError(f"plot_collectives() draws into two Axes (latency, bandwidth), got "
                         f"{len(ax)}")
    plot_latency(records, ax=ax[0])
    plot_busbw(records, ax=ax[1], limit=limit, limit_label=limit_label)
    if isinstance(ax[0].figure.get_layout_engine(), ConstrainedLayoutEngine):
        style.legend_below(ax[0].figure, ax, last=(_NOISY,))  # each panel keeps its whole width for the data
    return ax


@style.styled
def plot_timeline(trace, ax=None):
    """Per-rank timeline of a :class:`nbdist.bench.Trace`: a bar per collective, coloured by
    op, over a light band for each rank's traced block. Times in ms from the earliest start."""
    events = list(trace.events)
    spans = dict(trace.spans)
    ranks = sorted(set(spans) | {e["rank"] for e in events})
    if ax is None:
        _, ax = style.new_figure(0.6 * len(ranks) + 1.6)
    starts = [b for b, _ in spans.values()] + [e["start"] for e in events]
    t0 = min(starts) if starts else 0.0
    label = "traced block"  # one legend entry for the bands
    for rank, (begin, end) in spans.items():
        ax.broken_barh([((begin - t0) * 1e3, (end - begin) * 1e3)], (rank - 0.45, 0.9),
                       color="0.93", zorder=0, label=label)
        label = None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ops = list(dict.fromkeys(e["op"] for e in events))
    for i, op in enumerate(ops):
        label = op
        for rank in ranks:
            bars = [((e["start"] - t0) * 1e3, max(e["duration"] * 1e3, 1e-3))
                    for e in events if e["op"] == op and e["rank"] == rank]
            if bars:
                ax.broken_barh(bars, (rank - 0.35, 0.7), color=colors[i % len(colors)],
                               edgecolor="white", linewidth=0.5, label=label)
                label = None  # one legend entry per op
    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks, default=0) + 0.7, min(ranks, default=0) - 0.7)
    ax.set_xlabel("time (ms)")
    ax.set_title(f"collectives on {len(ranks)} rank{'s' if len(ranks) != 1 else ''}")
    style.legend_outside(ax)
    return ax
