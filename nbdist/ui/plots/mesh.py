"""The picture of a device mesh: which rank sits where, and who talks to whom along each dimension.

Takes a layout (:class:`nbdist.parallel.MeshLayout`: ``sizes``, ``grid()``, ``groups(dim)``) and
``ax=None``; returns the Axes it drew on.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from . import style

_GAP = 0.8  # between the grids of the outer dimensions (pp=0, pp=1, ...)


@style.styled
def plot_mesh(layout, ax=None):
    """Ranks as boxes in their grid: rows along the second-to-last dimension, columns along the
    last, one grid per index of the outer dimensions. Boxes of one group along the last
    dimension share a colour; the groups along every dimension are listed under the grid."""
    if not all(hasattr(layout, a) for a in ("sizes", "grid", "groups")):
        raise TypeError(f"plot_mesh() draws a nbdist.parallel.MeshLayout, got "
                        f"{type(layout).__name__}; build one with MeshLayout(world_size, dp=..., "
                        "tp=...)")
    names = list(layout.sizes)
    rows_dim, col_dim = (names[-2] if len(names) > 1 else None), names[-1]
    grids = layout.grid()
    n_rows, n_cols = len(grids[0][1]), len(grids[0][1][0])
    listing = "\n".join(f"groups along {d}: " + " ".join(str(g) for g in layout.groups(d))
                        for d in names)
    if ax is None:  # room for the grids and for the listing under them (9 pt monospace)
        chars = max(len(line) for line in listing.split("\n"))
        width = max(3.0, len(grids) * (n_cols + _GAP) * 0.9 + 1.0, chars * 0.078 + 0.6)
        _, ax = style.new_figure(1.3 + n_rows * 0.75 + 0.25 * len(names),
                                 width=min(width, style.WIDTH))
    colours = plt.get_cmap("tab10")
    inner = {r: i for i, g in enumerate(layout.groups(col_dim)) for r in g}
    for g_index, (fixed, rows) in enumerate(grids):
        x0 = g_index * (n_cols + _GAP)
        for r, row in enumerate(rows):
            for c, rank in enumerate(row):
                y = n_rows - 1 - r
                ax.add_patch(plt.Rectangle((x0 + c + 0.05, y + 0.05), 0.9, 0.9,
                                           facecolor=colours(inner[rank] % 10), alpha=0.35,
                                           edgecolor="black"))
                ax.text(x0 + c + 0.5, y + 0.5, f"rank {rank}", ha="center", va="center")
        for c in range(n_cols):
            ax.text(x0 + c + 0.5, n_rows + 0.1, f"{col_dim}={c}", ha="center", va="bottom",
                    fontsize=9)
        if fixed:
            ax.text(x0 + n_cols / 2, n_rows + 0.5, ", ".join(f"{k}={v}" for k, v in fixed.items()),
                    ha="center", va="bottom", fontweight="bold")
    if rows_dim:
        for r in range(n_rows):
            ax.text(-0.1, n_rows - 1 - r + 0.5, f"{rows_dim}={r}", ha="right", va="center",
                    fontsize=9)
    ax.text(0, -0.15, listing, ha="left", va="top", fontsize=9, family="monospace")
    ax.set_xlim(-1.0 if rows_dim else -0.2, len(grids) * (n_cols + _GAP) - _GAP + 0.2)
    ax.set_ylim(-0.3 - 0.3 * len(names), n_rows + (0.9 if grids[0][0] else 0.5))
    ax.set_aspect("equal")
    ax.axis("off")
    dims = " x ".join(f"{d}={s}" for d, s in layout.sizes.items())
    ax.set_title(f"mesh {dims} over {layout.world_size} ranks")
    return ax
