"""The Gantt chart of a pipeline step (:class:`nbdist.parallel.Timeline`): one row per rank,
each microbatch's forward and backward as a bar numbered with the microbatch, gaps where the rank
waits. Takes the timeline and ``ax=None``; returns the Axes it drew on (no ``plt.show()``).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452"}
_LIGHT = {"forward": "#8fa9d6", "backward": "#f0b78f"}  # a rank's second stage (interleaved)


def plot_pipeline(timeline, ax=None):
    """Per-rank bars of forward (blue) and backward (orange) of every microbatch against time
    (ms from the first compute of the step); a rank's later stages (interleaved schedules) in a
    lighter shade. The title gives the measured bubble and the schedule's theory."""
    if not timeline.events:
        raise ValueError("plot_pipeline() got a timeline without events: record a step with "
                         "pipe.timeline(x, y) (or pipe.step(x, y, record=True)) on every rank "
                         "and merge them with Timeline.merge(...)")
    if ax is None:
        ranks = len({e["rank"] for e in timeline.events})
        _, ax = plt.subplots(figsize=(9, 0.7 * ranks + 1.4))
    begin, _ = timeline.window
    first_stage = {}
    for e in timeline.events:
        first_stage[e["rank"]] = min(first_stage.get(e["rank"], e["stage"]), e["stage"])
    for e in timeline.events:
        start, width = (e["start"] - begin) * 1e3, (e["end"] - e["start"]) * 1e3
        colours = _COLOURS if e["stage"] == first_stage[e["rank"]] else _LIGHT
        ax.barh(e["rank"], width, left=start, height=0.7, color=colours[e["kind"]],
                edgecolor="white", linewidth=0.5)
        ax.text(start + width / 2, e["rank"], str(e["microbatch"]), ha="center", va="center",
                fontsize=7, color="white", clip_on=True)
    ranks = sorted({e["rank"] for e in timeline.events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
    ax.set_xlabel("time (ms) from the step's first compute")
    b = timeline.bubble()
    theory = "n/a" if b["theory"] is None else f"{b['theory']:.0%}"
    ax.set_title(f"{timeline.schedule}, m={timeline.microbatches}, p={timeline.ranks}: bubble "
                 f"{b['measured']:.0%} measured, {theory} in theory", fontsize=10, loc="left")
    ax.legend(handles=[Patch(color=_COLOURS["forward"], label="forward"),
                       Patch(color=_COLOURS["backward"], label="backward")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=2, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    return ax
