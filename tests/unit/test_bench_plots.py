"""The benchmark's plots on made-up records (no processes): a far memcpy limit leaves the curves
readable, noisy points are marked."""
import matplotlib
import pytest

from nbdist import bench
from nbdist.bench import Records

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

pytestmark = pytest.mark.timeout(30)

META = dict(dtype="float32", world_size=4, backend="gloo", device="cpu", iters=3, warmup=1)


def point(nbytes, times):
    res = {"status": "ok", "bytes": nbytes, "count": nbytes // 4, "times": times,
           "verified": True, "note": None}
    return bench.summarize("all_reduce", [res, res], **META)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_a_limit_far_above_the_curves_does_not_squeeze_them():
    recs = Records([point(1 << 20, [1e-3] * 3), point(4 << 20, [2e-3] * 3)])  # 1.6, 3.1 GB/s
    top = max(r["busbw_GBps"] for r in recs)
    ax = recs.plot("busbw", limit=10.1, limit_label="memcpy")
    assert ax.get_ylim()[1] < 1.2 * top  # the curves fill the plot; no line at 10.1
    assert 10.1 not in [y for line in ax.get_lines() for y in line.get_ydata()]
    legend = ax.figure.legends[0]  # under the plot: the "% of memcpy" axis takes the right side
    assert "memcpy (10.1 GB/s): above the plot" in [t.get_text() for t in legend.get_texts()]
    assert [a.get_ylabel() for a in ax.child_axes] == ["% of memcpy"]
    near = recs.plot("busbw", limit=4.0, limit_label="memcpy")
    assert [line.get_label() for line in near.get_lines()][-1] == "memcpy (4 GB/s)"
    assert near.get_ylim()[1] >= 4.0


def test_noisy_points_are_hollow_once_in_the_legend():
    """Issue 35: red rings covered 25 of tutorial 03's 34 points on a busy machine; a noisy
    point is now its line's own marker, hollow, and the line's filled markers skip it."""
    from matplotlib.colors import to_hex

    recs = Records([point(1 << 20, [1e-3, 1e-3, 1e-3, 9e-3, 1e-3]), point(2 << 20, [1e-3] * 3),
                    point(4 << 20, [2e-3, 2e-3, 9e-3, 2e-3, 2e-3])])
    assert [r["noisy"] for r in recs] == [True, False, True]
    for ax in recs.plot(limit=4.0):
        marks = [c for c in ax.collections if c.get_offsets().shape[0]]
        hollow = sorted(x for c in marks for x, _ in c.get_offsets())
        assert hollow == [1 << 20, 4 << 20]
        (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "all_reduce"]
        assert list(line.get_markevery()) == [1]  # the filled marker only where not noisy
        assert all(to_hex(c.get_edgecolor()[0]) == to_hex(line.get_color()) and
                   to_hex(c.get_facecolor()[0]) == "#ffffff" for c in marks)
        legend = ax.get_legend() or ax.figure.legends[0]  # the pair shares one legend below
        labels = [t.get_text() for t in legend.get_texts()]
        noisy = "hollow: noisy (p90 > 2× p10)"
        assert labels.count(noisy) == 1 and labels[-1] == noisy
