"""The Metrics table, its plot and the live view's checks, on rows made here (no ranks needed)."""
import json

import pytest

from nbdist.runtime.metrics import FIELDS, Metrics


def _metrics(n=5):
    m = Metrics()
    m.add([(r, i, "loss", 1.0 / (i + 1), 100.0 + i) for r in (0, 1) for i in range(n)])
    m.add([(0, n - 1, "lr", 0.1, 200.0), (1, None, "note", 3, 201.0)])
    return m


def test_rows_last_series_and_exports():
    m = _metrics()
    assert len(m) == 12 and m.names() == ["loss", "lr", "note"]
    assert m.last()[0] == {"loss": (4, 0.2), "lr": (4, 0.1)}
    assert m.last_step() == {0: 4, 1: 4}
    assert m.series("loss", 1) == ([0, 1, 2, 3, 4], [1.0, 0.5, 1 / 3, 0.25, 0.2])
    assert m.series("note", 1) == ([0], [3])  # no step: log order
    csv_text = m.to_csv()
    assert csv_text.splitlines()[0] == ",".join(FIELDS)
    assert csv_text.splitlines()[-1] == "1,,note,3,201.0"
    rows = json.loads(m.to_json())
    assert rows[0] == {"rank": 0, "step": 0, "name": "loss", "value": 1.0, "time_s": 100.0}
    assert list(m.to_pandas().columns) == list(FIELDS)
    assert "rank 0 step 4: loss=0.2, lr=0.1" in repr(m)
    assert repr(Metrics()) == "<nbdist Metrics: nothing logged yet>"


def test_times_read_in_their_unit_and_the_summary_is_a_table_with_units():
    m = Metrics()
    for i in range(30):
        m.add([(r, i, "step_s", 0.0129 + 0.001 * r, 0.0) for r in (0, 1)]
              + [(r, i, "data_ms", 10.2 if r else 0.07, 0.0) for r in (0, 1)]
              + [(r, i, "loss", 1.0 / (i + 1), 0.0) for r in (0, 1)])
    # named without the unit suffix its value is not shown in (issue 35: "data_ms = 137 µs")
    assert "rank 1 step 29: step=13.9 ms, data=10.2 ms, loss=0.03333" in repr(m)
    table = m.summary(window=10)
    # every time in the step's unit (issue 35: "comm (µs)" next to "step (ms)")
    assert [h.strip() for h in str(table).splitlines()[0].split("  ") if h.strip()] == [
        "rank", "last step", "step (ms)", "data (ms)", "loss"]
    assert str(table).splitlines()[2].split() == ["0", "29", "12.9", "0.070", "0.039"]  # plain numbers: 3 decimals at most
    assert table.rows[1]["data_s"] == pytest.approx(0.0102)  # raw values, in seconds
    assert table.notes == ["median of each rank's last 10 values; times in one unit"]


def test_the_split_adds_up_to_the_median_step_the_summary_shows():
    """Issue 35: the live view's bars totalled about 15 ms against the table's 18 ms step: the
    medians of compute and of communication do not add up to the median step."""
    m = Metrics()
    for i in range(20):  # compute and communication take turns being slow: their medians are low
        compute, comm = (0.010, 0.002) if i % 2 else (0.004, 0.008)
        m.add([(0, i, "compute_s", compute, 0.0), (0, i, "comm_s", comm, 0.0),
               (0, i, "step_s", compute + comm, 0.0)])
    compute, comm = m.split()[0]
    step = m.summary().rows[0]["step_s"]
    assert compute + comm == pytest.approx(step) == pytest.approx(0.012)
    assert compute / comm == pytest.approx(0.007 / 0.005)  # the parts' medians' proportion


def test_plot_metrics_panels_thinning_and_errors():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from nbdist.ui.plots import metrics as plots

    axes = _metrics().plot()
    assert [a.get_ylabel() for a in axes] == ["loss", "lr", "note"]
    assert [line.get_label() for line in axes[0].get_lines()] == ["rank 0", "rank 1"]
    big = Metrics()
    big.add([(0, i, "loss", float(i), 0.0) for i in range(plots.MAX_POINTS * 3)])
    (ax,) = big.plot()
    assert ax.get_title() == "loss (thinned)" and len(ax.get_lines()[0].get_xdata()) == 2000
    shared = Figure().subplots()
    _metrics().plot(names=["loss", "lr"], ax=shared)
    assert "loss, rank 0" in [line.get_label() for line in shared.get_lines()]
    with pytest.raises(ValueError, match="got 1 Axes for 2 scalars .loss, lr.: give one Axes "
                                         "per scalar, or a single one"):
        plots.plot_metrics(_metrics(), ["loss", "lr"], ax=[shared])
    with pytest.raises(ValueError, match="found nothing to draw: log scalars on the ranks"):
        Metrics().plot()
    matplotlib.pyplot.close("all")


def test_the_live_view_refuses_to_redraw_too_often():
    pytest.importorskip("ipywidgets")
    from nbdist.ui.live import Watch

    with pytest.raises(ValueError, match="every must be at least 0.5 s .the view redraws at most "
                                         "twice a second., got 0.1"):
        Watch(object(), every=0.1)


def test_merged_length_counts_overlaps_once_and_clips():
    from nbdist.bench.steps import merged_length

    assert merged_length([(1, 3), (2, 4), (6, 7)], 0, 10) == 4
    assert merged_length([(1, 3), (2, 4)], 2.5, 3.5) == 1.0
    assert merged_length([], 0, 1) == 0.0


def test_stragglers_from_compute_times():
    m = Metrics()
    m.add([(r, i, "compute_s", 0.01 * (3 if r == 2 else 1), 0.0) for r in range(4)
           for i in range(30)])
    assert m.stragglers() == {2: 3.0}
    assert m.stragglers(factor=4.0) == {}
    assert Metrics().stragglers() == {}


def test_the_table_is_bounded_older_rows_thinned_recent_ones_whole():
    m = Metrics(max_rows=1000)
    for i in range(3000):
        m.add([(r, i, "loss", float(i), 0.0) for r in (0, 1)])
    assert len(m) <= 1000 and m.dropped == 6000 - len(m)
    steps, _ = m.series("loss", 1)
    assert steps[-50:] == list(range(2950, 3000))  # the recent steps are all there
    assert steps[0] == 0 and steps == sorted(steps)  # older ones sparser, in order
    assert sum(1 for r in m.rows() if r[0] == 0) == sum(1 for r in m.rows() if r[0] == 1)
    assert f"(older rows thinned: {m.dropped} dropped)" in repr(m)
    keep = Metrics(max_rows=None)
    keep.add([(0, i, "x", i, 0.0) for i in range(5000)])
    assert len(keep) == 5000 and keep.dropped == 0


def test_the_step_split_per_rank_and_its_panel():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from nbdist.ui.plots.metrics import plot_step_split

    m = Metrics()
    for i in range(40):  # rank 1's compute is 3x; the first 20 steps were all slower
        slow = 10 if i < 20 else 1
        m.add([(r, i, "compute_s", 0.01 * slow * (3 if r == 1 else 1), 0.0) for r in (0, 1, 2)])
        m.add([(r, i, "comm_s", 0.005, 0.0) for r in (0, 1, 2)])
    split = m.split()  # without step_s: the parts' medians
    assert {r: pytest.approx(v) for r, v in split.items()} == {
        0: (0.01, 0.005), 1: (0.03, 0.005), 2: (0.01, 0.005)}
    ax = plot_step_split(m, ax=Figure().subplots())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert [t.get_text() for t in ax.texts] == ["rank 1: straggler (compute 3.00× the median)"]
    assert ax.get_title(loc="left") == "step time per rank, median of the last 20 steps"
    # 35 ms at most: in ms; every rank's communication takes the same: no waiting to point out
    assert ax.get_xlabel() == "time per step (ms)"
    with pytest.raises(ValueError, match="plot_step_split\\(\\) found no step times: wrap each "
                                         "step in `with nbdist.step\\(i\\):` on the ranks"):
        plot_step_split(_metrics())
