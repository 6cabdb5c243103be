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
_PAD_PX = 4  # a label is drawn only on a bar at least its estimated width plus this many pixels
_MARGIN = 0.02  # the time axis runs this share past the end, so the last bar's edge shows


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


def _ms(seconds: float) -> str:
    """A step's length in ms: whole from 10 ms (``912``, ``24``), else 3 significant digits
    (``7.31``, ``0.731``)."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 10 else f"{ms:.3g}"


@style.styled
def plot_pipeline(timeline, ax=None, span=None):
    """Per-rank bars of forward (blue) and backward (orange) of every microbatch against time
    (ms from the first compute of the step); a rank's later stages (interleaved schedules) in a
    lighter shade, named in the legend. The title gives the step's length (the makespan, what
    ``timeline.bubble()["makespan_s"]`` says), the measured bubble and the theory.

    The time axis runs a little past the step's end. ``span`` (seconds, at least the step's
    makespan) sets the length it covers instead: draw several steps with the same ``span`` (the
    longest makespan) and their bars compare on one scale."""
    if not timeline.events:
        raise ValueError("plot_pipeline() got a timeline without events: record a step with "
                         "pipe.timeline(x, y) (or pipe.step(x, y, record=True)) on every rank "
                         "and merge them with Timeline.merge(...)")
    begin, end = timeline.window
    if span is None:
        span = end - begin
    elif span < (end - begin) * (1 - 1e-9):
        raise ValueError(f"plot_pipeline(span={span!r}) is shorter than the step it draws "
                         f"({(end - begin):.6f} s), which would cut it off; pass the longest "
                         f"makespan of the steps you compare (bubble()['makespan_s'])")
    ranks = sorted({e["rank"] for e in timeline.events})
    if ax is None:
        _, ax = style.new_figure(0.6 * len(ranks) + 2.0)
    first_stage = {}
    for e in timeline.events:
        first_stage[e["rank"]] = min(first_stage.get(e["rank"], e["stage"]), e["stage"])
    ax.set_xlim(0, span * 1e3 * (1 + _MARGIN))
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    later = any(e["stage"] != first_stage[e["rank"]] for e in timeline.events)
    ax.set_xlabel("time (ms) from the step's first compute; numbers: microbatch")
    b = timeline.bubble()
    theory = "n/a" if b["theory"] is None else f"{b['theory']:.0%}"
    rows = _legend(ax, timeline.ranks, later)
    # the title sits above the legend: a legend row at fontsize 8 is about 14 points high
    ax.set_title(f"{timeline.schedule}, m={timeline.microbatches}, p={timeline.ranks}: step "
                 f"{_ms(end - begin)} ms, bubble {b['measured']:.0%} measured, {theory} in "
                 f"theory", fontsize=10, loc="left", pad=6 + 14 * rows)
    ax.grid(True, axis="x", alpha=0.3)
    # the Axes' width once the layout has placed the title, legend and labels: which numbers
    # fit their bars depends on it
    if ax.figure.get_layout_engine() is not None:
        ax.figure.draw_without_rendering()
    px_per_ms = ax.bbox.width / (span * 1e3 * (1 + _MARGIN))
    digit_px = 0.6 * _LABEL_SIZE * ax.figure.dpi / 72  # about a digit's width at this size
    for e in timeline.events:
        start, width = (e["start"] - begin) * 1e3, (e["end"] - e["start"]) * 1e3
        colour = (_COLOURS if e["stage"] == first_stage[e["rank"]] else _LIGHT)[e["kind"]]
        ax.barh(e["rank"], width, left=start, height=0.7, color=colour, edgecolor="white",
                linewidth=0.5)
        label = str(e["microbatch"])
        if width * px_per_ms >= len(label) * digit_px + _PAD_PX:
            ax.text(start + width / 2, e["rank"], label, ha="center", va="center",
                    fontsize=_LABEL_SIZE, color=_ink(colour), clip_on=True)
    return ax
