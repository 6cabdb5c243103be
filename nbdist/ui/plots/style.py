"""The one look of nbdist's figures: a size that fits a notebook column, constrained layout (titles,
tick labels and axis labels never collide), legible fonts, a grid for many panels, and legends
outside the data.

Every plot function draws inside :func:`styled` (matplotlib's ``rc_context`` with :data:`RC`); a
figure nbdist makes itself comes from :func:`new_figure` (constrained layout, :data:`WIDTH` wide).
Axes the caller passes in keep their figure's size and layout: only the fonts follow the style.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, List, Sequence, Tuple

import matplotlib
import matplotlib.pyplot as plt

WIDTH = 9.5  #: inches: about 950 px at the default 100 dpi, the width of a notebook column
MAX_COLUMNS = 3  #: panels per row of a grid; more panels start another row

RC = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "figure.titlesize": 11,
    "axes.titlelocation": "center",
    "legend.frameon": False,
}
"""The rc settings every nbdist plot is drawn under (sizes in points)."""


def styled(plot: Callable) -> Callable:
    """Decorate a plot function: it draws under :data:`RC` (fonts, legend look)."""
    @functools.wraps(plot)
    def draw(*args, **kwargs):
        with matplotlib.rc_context(RC):
            return plot(*args, **kwargs)
    return draw


def grid(panels: int, max_columns: int = MAX_COLUMNS) -> Tuple[int, int]:
    """``(rows, columns)`` for ``panels`` (at least one) panels: at most ``max_columns`` side by
    side, so six panels make two rows of three, not one row of six."""
    assert panels >= 1, panels  # the plot functions refuse empty input before they lay it out
    columns = min(panels, max_columns)
    return math.ceil(panels / columns), columns


def new_figure(height: float, nrows: int = 1, ncols: int = 1, width: float = WIDTH, **kw):
    """A pyplot figure of ``width`` x ``height`` inches in constrained layout and its Axes (as
    ``plt.subplots`` returns them; ``kw`` goes to it)."""
    with matplotlib.rc_context(RC):
        return plt.subplots(nrows, ncols, figsize=(width, height), layout="constrained", **kw)


def legend_outside(ax, last: Sequence[str] = (), **kw):
    """The Axes' legend to the right of it, outside the plotted area, so it covers no data
    (constrained layout makes room); entries labelled as in ``last`` go at the end. ``None``
    when nothing is labelled."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    order = sorted(range(len(labels)), key=lambda k: labels[k] in last)
    handles, labels = [handles[k] for k in order], [labels[k] for k in order]
    return ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                     borderaxespad=0.0, **kw)


def legend_below(fig, axes: Sequence, max_columns: int = 4, last: Sequence[str] = ()):
    """One legend for several Axes, centred under them (each label once); the Axes' own legends
    are removed; entries labelled as in ``last`` go at the end. Needs constrained layout
    (:func:`new_figure`); ``None`` when nothing is labelled."""
    handles: List = []
    labels: List[str] = []
    for old in [leg for leg in fig.legends if getattr(leg, "nbdist", False)]:
        old.remove()  # an earlier legend_below for some of these Axes: this one replaces it
    for ax in axes:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    if not handles:
        return None
    order = sorted(range(len(labels)), key=lambda k: labels[k] in last)
    handles, labels = [handles[k] for k in order], [labels[k] for k in order]
    legend = fig.legend(handles, labels, loc="outside lower center",
                        ncols=min(max_columns, len(labels)))
    legend.nbdist = True
    return legend
