"""The Gantt chart of a pipeline step (:class:`nbdist.parallel.Timeline`): one row per rank,
each microbatch's forward and backward as a bar, gaps where the rank waits. A bar wide enough for
its microbatch's number carries it, in the ink that reads best on the bar's colour; thinner bars
carry none. Takes the timeline and ``ax=None``; returns the Axes it drew on (no ``plt.show()``).
"""
from __future__ import annotations

from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from . import style

_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452"}
_LIGHT = {"forward": "#a7bce0", "backward": "#f3c8a8"}  # a rank's later stages (interleaved)
_DARK_INK, _LIGHT_INK = "#1a1a1a", "white"
_LABEL_SIZE = 7  # points
_PAD = 1.5  # a label is drawn only on a bar at least this many times its estimated width


def _luminance(colour) -> float:
    """WCAG relative luminance of a colour."""
    def channel(c):
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (channel(c) for c in to_rgb(colour))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _ink(colour) -> str:
    """The text colour (near-black or white) with the higher contrast on ``colour``."""
    lum = _luminance(colour)
    on_dark = (1.05) / (lum + 0.05)
    on_light = (lum + 0.05) / (_luminance(_DARK_INK) + 0.05)
    return _LIGHT_INK if on_dark > on_light else _DARK_INK


def _legend(ax, ranks: int, later: bool):
    handles = [Patch(color=_COLOURS["forward"], label="forward"),
               Patch(color=_COLOURS["backward"], label="backward")]
    if later:  # interleaved: name the rank's stages the two shades stand for
        handles = [Patch(color=_COLOURS["forward"], label="forward, stage r"),
                   Patch(color=_COLOURS["backward"], label="backward, stage r"),
                   Patch(color=_LIGHT["forward"], label=f"forward, stage r+{ranks}"),
                   Patch(color=_LIGHT["backward"], label=f"backward, stage r+{ranks}")]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8,
              ncol=2, frameon=False, borderaxespad=0.2, borderpad=0.2)
    return (len(handles) + 1) // 2  # rows of the legend, above the axes


@style.styled
def plot_pipeline(timeline, ax=None):
    """Per-rank bars of forward (blue) and backward (orange) of every microbatch against time
    (ms from the first compute of the step); a rank's later stages (interleaved schedules) in a
    lighter shade, named in the legend. The title gives the measured bubble and the theory."""
    if not timeline.events:
        raise ValueError("plot_pipeline() got a timeline without events: record a step with "
                         "pipe.timeline(x, y) (or pipe.step(x, y, record=True)) on every rank "
                         "and merge them with Timeline.merge(...)")
    ranks = sorted({e["rank"] for e in timeline.events})
    if ax is None:
        _, ax = style.new_figure(0.6 * len(ranks) + 2.0)
    begin, end = timeline.window
    first_stage = {}
    for e in timeline.events:
        first_stage[e["rank"]] = min(first_stage.get(e["rank"], e["stage"]), e["stage"])
    ax.set_xlim(0, (end - begin) * 1e3)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    px_per_ms = ax.bbox.width / max((end - begin) * 1e3, 1e-9)
    digit_px = 0.6 * _LABEL_SIZE * ax.figure.dpi / 72  # about a digit's width at this size
    later = False
    for e in timeline.events:
        start, width = (e["start"] - begin) * 1e3, (e["end"] - e["start"]) * 1e3
        shades = _COLOURS if e["stage"] == first_stage[e["rank"]] else _LIGHT
        later = later or shades is _LIGHT
        colour = shades[e["kind"]]
        ax.barh(e["rank"], width, left=start, height=0.7, color=colour, edgecolor="white",
                linewidth=0.5)
        label = str(e["microbatch"])
        if width * px_per_ms >= _PAD * (len(label) + 1) * digit_px:
            ax.text(start + width / 2, e["rank"], label, ha="center", va="center",
                    fontsize=_LABEL_SIZE, color=_ink(colour), clip_on=True)
    ax.set_xlabel("time (ms) from the step's first compute; numbers: microbatch")
    b = timeline.bubble()
    theory = "n/a" if b["theory"] is None else f"{b['theory']:.0%}"
    rows = _legend(ax, timeline.ranks, later)
    # the title sits above the legend: a legend row at fontsize 8 is about 14 points high
    ax.set_title(f"{timeline.schedule}, m={timeline.microbatches}, p={timeline.ranks}: bubble "
                 f"{b['measured']:.0%} measured, {theory} in theory", fontsize=10, loc="left",
                 pad=6 + 14 * rows)
    ax.grid(True, axis="x", alpha=0.3)
    return ax
