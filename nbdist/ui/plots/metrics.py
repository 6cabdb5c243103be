"""Plots of the scalars ranks logged with ``nbdist.log``: one panel per scalar, one line per rank,
and the live view's whole figure (:func:`live_figure`).

Takes the table (:class:`nbdist.runtime.metrics.Metrics`, e.g. ``job.metrics``) and ``ax=None``;
returns the Axes it drew on. Beyond :data:`MAX_POINTS` points per rank and scalar, lines are
thinned to every n-th point (the title says so), so a long run stays quick to draw. A scalar whose
name ends in ``_s``, ``_ms``, ``_us`` or ``_ns`` is a time: its panel is drawn in one unit (s, ms,
µs or ns) chosen for the panel's values, and the axis says which.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from ...errors import ranks_phrase
from ...report.units import format_time, percentile, seconds_per_unit
from . import style

_COMPUTE, _COMM = "0.35", "0.75"  #: the step split's two parts: dark and light grey
MAX_POINTS = 2000  #: points drawn per rank and scalar; more are thinned evenly
_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))
NOTE_WIDTH = 110  #: characters per line of the live figure's note; longer lines are cut


def time_unit(seconds: float) -> Tuple[str, float]:
    """``(unit, seconds per unit)`` that shows ``seconds`` (a panel's typical largest value) as
    1 to 999 of it: ``0.013`` -> ``("ms", 1e-3)``."""
    return next(((u, s) for u, s in _UNITS if abs(seconds) >= s), ("ns", 1e-9))


def _colors(ranks: Sequence[int]) -> dict:
    """One colour per rank, the same in every panel of a figure."""
    return {r: f"C{i % 10}" for i, r in enumerate(sorted(ranks))}


@style.styled
def plot_metrics(metrics, names: Optional[Sequence[str]] = None, ax=None,
                 legend: bool = True) -> List:
    """Per-rank curves of each logged scalar against step; returns the list of Axes.

    ``names``: the scalars to draw (default: all, in first-logged order). ``ax``: one Axes (every
    scalar drawn on it) or a list of Axes, one per scalar. ``legend``: a legend in each panel (the
    live view draws one for the whole figure instead). Times are drawn in the unit that suits
    the panel (``time (ms)``).
    """
    names = list(names) if names is not None else metrics.names()
    if not names:
        raise ValueError("plot_metrics() found nothing to draw: log scalars on the ranks with "
                         "nbdist.log(step=i, loss=loss) first")
    if ax is None:
        rows, cols = style.grid(len(names))
        _, axes = style.new_figure(3.0 * rows, rows, cols, squeeze=False)
        axes = list(axes.flat)[:len(names)]
        for spare in list(axes[0].figure.axes)[len(names):]:
            spare.remove()  # the grid's cells after the last scalar stay empty
    elif isinstance(ax, (list, tuple)):
        if len(ax) != len(names):
            raise ValueError(f"plot_metrics() got {len(ax)} Axes for {len(names)} scalars "
                             f"({', '.join(names)}): give one Axes per scalar, or a single one")
        axes = list(ax)
    else:
        axes = [ax] * len(names)
    ranks = sorted({row["rank"] for row in metrics})
    color = _colors(ranks)
    shared = len(names) > 1 and all(a is axes[0] for a in axes)
    for name, axis in zip(names, axes):
        thinned = bool(getattr(metrics, "dropped", 0))  # the table itself thinned old rows
        series = {r: metrics.series(name, r) for r in ranks}
        scale = seconds_per_unit(name)
        unit = None
        if scale is not None and not shared:
            values = [abs(v) * scale for _, ys in series.values() for v in ys
                      if isinstance(v, (int, float))]
            unit, per = time_unit(percentile(values, 95) or 0.0)
            scale /= per
        for rank, (xs, ys) in series.items():
            if not xs:
                continue
            step = max(1, len(xs) // MAX_POINTS)
            thinned = thinned or step > 1
            ys = [v * scale for v in ys] if unit else ys
            axis.plot(xs[::step], ys[::step], color=None if shared else color[rank],
                      label=f"{name}, rank {rank}" if shared else f"rank {rank}")
        axis.set_xlabel("step")
        axis.set_ylabel(f"time ({unit})" if unit else name)
        # a time's panel is named without its unit suffix (step_s -> step): the axis gives the
        # unit it is drawn in, as the summary's header does
        title = name[:name.rindex("_")] if unit else name
        axis.set_title(title + (" (thinned)" if thinned else ""))
        if legend:
            axis.legend(fontsize="small")
    return axes


@style.styled
def plot_step_split(metrics, window: int = 20, ax=None):
    """Each rank's step time split into compute and communication (its median step over its last
    ``window`` steps, from ``nbdist.step``: the step ``summary()`` shows, split in the proportion
    of the parts' medians), as stacked horizontal bars in greys (the ranks' colours belong to
    the panels below), in the unit that suits them;
    stragglers are named inside the panel, and the x-axis label says what a fast rank's
    communication is then: waiting for the slow rank. Returns the Axes."""
    split = metrics.split(window)
    if not split:
        raise ValueError("plot_step_split() found no step times: wrap each step in "
                         "`with nbdist.step(i):` on the ranks")
    if ax is None:
        _, ax = style.new_figure(1.6 + 0.35 * len(split))
    ranks = sorted(split)
    unit, per = time_unit(max(c + m for c, m in split.values()))
    compute = [split[r][0] / per for r in ranks]
    comm = [split[r][1] / per for r in ranks]
    # greys: the panels under this one give each rank a colour (C0, C1...), so blue and orange
    # here would read as ranks
    ax.barh(ranks, compute, color=_COMPUTE, label="compute")
    ax.barh(ranks, comm, left=compute, color=_COMM, label="communication")
    slow = metrics.stragglers(window)
    for r, x in slow.items():  # in the right part of the panel, which the bars leave free
        ax.annotate(f"rank {r}: straggler (compute {x:.2f}× the median)", xy=(1, r),
                    xycoords=("axes fraction", "data"), xytext=(-4, 0),
                    textcoords="offset points", ha="right", va="center", fontsize="small",
                    color="tab:red")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    room = 1.7 if slow else 1.1  # the right part is for the straggler's note
    ax.set_xlim(0, room * max(c + m for c, m in zip(compute, comm)) or 1.0)
    # the lesson quotes the communication medians, as the summary table does (the bars are the
    # median step, split in their proportion)
    comm_medians = {row["rank"]: row.get("comm_s", 0.0) for row in metrics.summary(window).rows}
    ax.set_xlabel(f"time per step ({unit})" + _lesson(comm_medians, slow))
    ax.set_title(f"step time per rank, median of the last {window} steps", loc="left")
    ax.legend(fontsize="small", loc="lower right", bbox_to_anchor=(1, 1), ncol=2,
              frameon=False, borderaxespad=0.1)
    return ax


def _lesson(comm, slow) -> str:
    """What the bars teach when a rank is slow and the others' communication (``comm``: each
    rank's median) takes well over the slow rank's own: it is mostly waiting for the slow
    rank."""
    fast = [r for r in sorted(comm) if r not in slow]
    if not slow or not fast:
        return ""
    waited = percentile([comm[r] for r in fast], 50)
    own = percentile([comm[r] for r in slow], 50)
    if waited < 1.5 * own:  # the fast ranks' communication is not mostly waiting: say nothing
        return ""
    who = ("the fast " if len(fast) > 1 else "") + ranks_phrase(fast)
    return (f"\nThe communication of {who} ({format_time(waited)}) is mostly waiting for the "
            f"slow {ranks_phrase(list(slow))}:\na collective ends only when its slowest rank "
            f"arrives ({ranks_phrase(list(slow))}'s own communication: {format_time(own)}).")


@style.styled
def live_figure(metrics, note: Optional[str] = None, window: int = 20):
    """The live view's figure of a job's metrics, one notebook column wide (:data:`style.WIDTH`): the step split per rank on top
    (when the ranks use ``nbdist.step``), then one panel per logged scalar in a grid of up to
    three columns, one legend of the ranks; ``note`` (e.g. why the job is stalled and where the
    ranks are) in red above. Returns a ``matplotlib.figure.Figure`` (no pyplot)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    names = metrics.names()
    if not names:
        raise ValueError("live_figure() found nothing to draw: log scalars on the ranks with "
                         "nbdist.log(step=i, loss=loss) first")
    split = metrics.split(window) if "compute_s" in names else {}
    ranks = sorted({row["rank"] for row in metrics})
    cols = 1 if len(names) == 1 else 2 if len(names) in (2, 4) else 3
    rows = math.ceil(len(names) / cols)
    heights = ([1.7 + 0.3 * len(split)] if split else []) + [2.4] * rows
    lines = [_cut(line) for line in (note or "").splitlines()[:5]]
    fig = Figure(figsize=(style.WIDTH, sum(heights) + 0.5 + 0.2 * len(lines)), layout="constrained")
    grid = fig.add_gridspec(len(heights), cols, height_ratios=heights)
    if split:
        plot_step_split(metrics, window, ax=fig.add_subplot(grid[0, :]))
    top = 1 if split else 0
    axes = [fig.add_subplot(grid[top + i // cols, i % cols]) for i in range(len(names))]
    plot_metrics(metrics, names, ax=axes, legend=False)
    color = _colors(ranks)
    fig.legend(handles=[Line2D([], [], color=color[r], label=f"rank {r}") for r in ranks],
               loc="outside lower center", ncol=min(len(ranks), 8), fontsize="small",
               frameon=False)
    if lines:
        fig.suptitle("\n".join(lines), color="tab:red", fontsize="small", x=0.01, ha="left")
    return fig


def _cut(line: str) -> str:
    return line if len(line) <= NOTE_WIDTH else line[:NOTE_WIDTH - 1] + "…"
