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
