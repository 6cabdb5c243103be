"""The live view's figure (issue 28): at its default size, with a realistic job -- four ranks, a
straggler, several scalars -- no text overlaps another or leaves the figure, every time axis names
its unit, and the lesson of the step split is said. Rows are made here; matplotlib renders them."""
import math
import random

import pytest

from nbdist.runtime.metrics import Metrics

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from figure_checks import layout_problems  # noqa: E402

from nbdist.ui.plots.metrics import live_figure  # noqa: E402

pytestmark = pytest.mark.timeout(60)
SLOW = 2  # the straggler: its data loader sleeps 10 ms a step


def _job_metrics(ranks=4, steps=150):
    """What tutorial 8's training logs, on ``ranks`` ranks: a fast rank's communication is mostly
    waiting for the slow one."""
    rnd, m = random.Random(0), Metrics()
    for i in range(steps):
        rows = []
        for r in range(ranks):
            compute = (0.0112 if r == SLOW else 0.0012) * (1 + 0.2 * rnd.random())
            comm = (0.0006 if r == SLOW else 0.0112) * (1 + 0.3 * rnd.random())
            rows += [(r, i, "step_s", compute + comm, 0.0), (r, i, "comm_s", comm, 0.0),
                     (r, i, "compute_s", compute, 0.0),
                     (r, i, "loss", 15 * math.exp(-i / 8) + 0.05 * rnd.random(), 0.0),
                     (r, i, "data_ms", (10.1 if r == SLOW else 0.07) + rnd.random(), 0.0),
                     (r, i, "lr", 0.05 * 0.99 ** i, 0.0)]
        m.add(rows)
    return m


@pytest.mark.parametrize("note", [None, "stalled: nothing logged or printed, no collective "
                                        "completed for 61 s\nranks 0, 1, 3: <dist-cell-3>:14 "
                                        "train -> all_reduce\nrank 2: <dist-cell-3>:9 train -> "
                                        "load_batch -> sleep"])
def test_no_text_overlaps_or_leaves_the_figure_at_the_default_size(note):
    fig = live_figure(_job_metrics(), note=note)
    width, height = fig.get_size_inches()
    assert 7 <= width <= 10.5 and height <= 11, "the figure fits a notebook column"
    texts = [t.get_text() for ax in fig.axes for t in ax.texts + [ax.title, ax._left_title]] + \
        [t.get_text() for leg in fig.legends for t in leg.texts] + [fig._suptitle.get_text()
                                                                    if fig._suptitle else ""]
    assert "rank 0" in texts and any("straggler" in t for t in texts), texts
    if note:
        assert any(t.startswith("stalled:") for t in texts), texts
    assert layout_problems(fig) == []
    for ax in fig.axes:  # an annotation stays inside its own panel
        inside = ax.get_window_extent()
        for text in ax.texts:
            box = text.get_window_extent()
            assert inside.x0 <= box.x0 and box.x1 <= inside.x1, text.get_text()


def test_every_time_axis_names_one_unit_chosen_for_its_magnitude():
    fig = live_figure(_job_metrics())
    labels = {ax.get_title() or ax.get_title(loc="left"): (ax.get_xlabel(), ax.get_ylabel())
              for ax in fig.axes}
    split = next(v for k, v in labels.items() if k.startswith("step time"))
    assert split[0].startswith("time per step (ms)")
    # a time's panel is named without its unit suffix; the axis gives the unit (issue 35:
    # "step_s" over an axis in ms)
    for name in ("step", "comm", "compute", "data"):  # all ~1-25 ms: shown in ms
        assert labels[name] == ("step", "time (ms)"), (name, labels[name])
    assert labels["loss"] == ("step", "loss") and labels["lr"] == ("step", "lr")
    ax = next(a for a in fig.axes if a.get_title() == "step")
    assert 5 < max(ax.get_lines()[0].get_ydata()) < 50  # the values were converted to ms


def test_the_split_is_not_in_the_ranks_colours():
    """Issue 35: blue and orange meant compute and communication on top, rank 0 and rank 1
    below."""
    from matplotlib.colors import to_hex

    fig = live_figure(_job_metrics())
    split = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("step time"))
    bars = {to_hex(p.get_facecolor()) for p in split.patches}
    lines = {to_hex(line.get_color()) for ax in fig.axes if ax is not split
             for line in ax.get_lines()}
    assert len(bars) == 2 and not bars & lines, (bars, lines)


def test_the_step_split_names_the_straggler_and_says_the_lesson():
    fig = live_figure(_job_metrics())
    split = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("step time"))
    texts = [t.get_text() for t in split.texts] + [split.get_xlabel()]
    assert any(f"rank {SLOW}: straggler" in t for t in texts), texts
    lesson = split.get_xlabel()
    assert "waiting for the slow rank" in lesson and f"rank {SLOW}" in lesson, lesson


def _only(metrics, names):
    kept = Metrics()
    kept.add([row for row in metrics.rows() if row[2] in names])
    return kept


@pytest.mark.parametrize("shape", ["8 ranks", "one scalar", "four scalars, no step split"])
def test_other_shapes_of_job_have_no_overlapping_text_either(shape):
    metrics = {"8 ranks": lambda: _job_metrics(ranks=8, steps=60),
               "one scalar": lambda: _only(_job_metrics(2, 60), {"loss"}),
               "four scalars, no step split": lambda: _only(
                   _job_metrics(2, 60), {"loss", "lr", "data_ms", "step_s"})}[shape]()
    fig = live_figure(metrics)
    assert 7 <= fig.get_size_inches()[0] <= 10.5
    assert layout_problems(fig) == []
