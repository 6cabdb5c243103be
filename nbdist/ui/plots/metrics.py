"""Plots of the scalars ranks logged with ``nbdist.log``: one panel per scalar, one line per rank.

Takes the table (:class:`nbdist.runtime.metrics.Metrics`, e.g. ``job.metrics``) and ``ax=None``;
returns the Axes it drew on. Beyond :data:`MAX_POINTS` points per rank and scalar, lines are
thinned to every n-th point (the title says so), so a long run stays quick to draw.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import matplotlib.pyplot as plt

MAX_POINTS = 2000  #: points drawn per rank and scalar; more are thinned evenly


def plot_metrics(metrics, names: Optional[Sequence[str]] = None, ax=None) -> List:
    """Per-rank curves of each logged scalar against step; returns the list of Axes.

    ``names``: the scalars to draw (default: all, in first-logged order). ``ax``: one Axes (every
    scalar drawn on it) or a list of Axes, one per scalar.
    """
    names = list(names) if names is not None else metrics.names()
    if not names:
        raise ValueError("plot_metrics() found nothing to draw: log scalars on the ranks with "
                         "nbdist.log(step=i, loss=loss) first")
    if ax is None:
        _, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.2), squeeze=False)
        axes = list(axes[0])
    elif isinstance(ax, (list, tuple)):
        if len(ax) != len(names):
            raise ValueError(f"plot_metrics() got {len(ax)} Axes for {len(names)} scalars "
                             f"({', '.join(names)}): give one Axes per scalar, or a single one")
        axes = list(ax)
    else:
        axes = [ax] * len(names)
    ranks = sorted({row["rank"] for row in metrics})
    for name, axis in zip(names, axes):
        thinned = bool(getattr(metrics, "dropped", 0))  # the table itself thinned old rows
        for rank in ranks:
            xs, ys = metrics.series(name, rank)
            if not xs:
                continue
            step = max(1, len(xs) // MAX_POINTS)
            thinned = thinned or step > 1
            shared = len(names) > 1 and all(a is axes[0] for a in axes)
            axis.plot(xs[::step], ys[::step],
                      label=f"{name}, rank {rank}" if shared else f"rank {rank}")
        axis.set_xlabel("step")
        axis.set_ylabel(name)
        axis.set_title(name + (" (thinned)" if thinned else ""))
        axis.legend(fontsize="small")
    return axes


def plot_step_split(metrics, window: int = 20, ax=None):
    """Each rank's step time split into compute and communication (median of its last ``window``
    steps, from ``nbdist.step``), as stacked horizontal bars; stragglers are named on their bar.
    Returns the Axes."""
    split = metrics.split(window)
    if not split:
        raise ValueError("plot_step_split() found no step times: wrap each step in "
                         "`with nbdist.step(i):` on the ranks")
    if ax is None:
        _, ax = plt.subplots(figsize=(4.2, 0.5 + 0.45 * len(split)))
    ranks = sorted(split)
    compute = [split[r][0] * 1e3 for r in ranks]
    comm = [split[r][1] * 1e3 for r in ranks]
    ax.barh(ranks, compute, color="tab:blue", label="compute")
    ax.barh(ranks, comm, left=compute, color="tab:orange", label="communication")
    slow = metrics.stragglers(window)
    for r, x in slow.items():
        ax.text(compute[ranks.index(r)] + comm[ranks.index(r)], r, f"  straggler ({x:.2f}x)",
                va="center", fontsize="small", color="tab:red")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.5 * max(c + m for c, m in zip(compute, comm)) or 1.0)  # room for the note
    ax.set_xlabel("time per step (ms)")
    ax.set_title(f"step split, median of the last {window} steps")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2,
              frameon=False)
    return ax
