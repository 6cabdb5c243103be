"""The pipeline Gantt chart is readable: numbers only on bars they fit, in an ink that reads on
the bar, both shades of an interleaved chart in the legend, units on the time axis, no text
overlapping other text (issue 28)."""
import pytest

from nbdist.parallel import Timeline

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from figure_checks import layout_problems  # noqa: E402
from matplotlib.colors import to_hex, to_rgb  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def interleaved(p=2, m=4, short=0.02):
    """Rank r runs stages r and r + p; every stage-p+ backward is ``short`` long (thin bars)."""
    parts = []
    for r in range(p):
        t, events = 0.0, []
        for stage in (r, r + p):
            for i in range(m):
                for kind, length in (("forward", 1.0), ("backward", short if stage >= p else 2.0)):
                    events.append(dict(rank=r, stage=stage, microbatch=i, kind=kind, start=t,
                                       end=t + length))
                    t += length + 0.1
        parts.append(Timeline("interleaved1f1b", m, p, 2 * p, events, {r: (0.0, t)}))
    return Timeline.merge(parts)


def contrast(a, b):
    """WCAG contrast ratio of two colours."""
    def lum(colour):
        r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
                   for c in to_rgb(colour))
        return 0.2126 * r + 0.7152 * g + 0.0722 * b
    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _bars(ax):
    return [p for p in ax.patches if p.get_width() > 0]


def _texts(ax):
    return [t for t in ax.texts if t.get_text()]


def test_numbers_only_on_bars_they_fit_in_an_ink_that_reads():
    tl = interleaved()
    ax = tl.plot()
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bars, labels = _bars(ax), _texts(ax)
    assert len(bars) == len(tl.events) == 32
    assert len(labels) == 24  # the 8 thin backward bars carry no number
    for text in labels:
        box = text.get_window_extent(renderer)
        holder = [b for b in bars if b.get_window_extent(renderer).contains(*box.get_points()[0])
                  and b.get_window_extent(renderer).contains(*box.get_points()[1])]
        assert holder, f"label {text.get_text()!r} is not inside a bar"
        face = to_hex(holder[0].get_facecolor())
        assert contrast(face, text.get_color()) >= 4.5, (face, text.get_color())  # WCAG AA
    plt.close(fig)


def test_interleaved_shades_are_in_the_legend_and_time_has_a_unit():
    ax = interleaved().plot()
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    assert names == ["forward, stage r", "backward, stage r", "forward, stage r+2",
                     "backward, stage r+2"]
    faces = [to_hex(h.get_facecolor()) for h in ax.get_legend().legend_handles]
    assert len(set(faces)) == 4
    assert faces[2:] == sorted({to_hex(p.get_facecolor()) for p in _bars(ax)} - set(faces[:2]))
    assert "(ms)" in ax.get_xlabel()
    plt.close(ax.figure)


@pytest.mark.parametrize("width", [9, 6.4])
def test_no_text_overlaps_other_text(width):
    tl = interleaved()
    fig, ax = plt.subplots(figsize=(width, 2.8), layout="constrained")  # a notebook of its own
    tl.plot(ax=ax)
    assert layout_problems(fig) == []
    plt.close(fig)


def test_the_title_gives_the_step_the_axis_shows_whole():
    """The chart's step is the one printed next to it (bubble()['makespan_s']), and its last
    bar ends inside the axes, not on their edge (issue 35)."""
    tl = interleaved()
    ax = tl.plot()
    step_ms = tl.bubble()["makespan_s"] * 1e3
    assert f"step {step_ms:.0f} ms" in ax.get_title(loc="left"), ax.get_title(loc="left")
    last = max(p.get_x() + p.get_width() for p in _bars(ax))
    assert last == pytest.approx(step_ms) and ax.get_xlim()[1] > last * 1.01
    plt.close(ax.figure)


def test_steps_drawn_with_one_span_share_a_scale():
    """Several schedules drawn with span= the longest step: one ms is as wide on each."""
    short, long_ = interleaved(short=0.02), interleaved(short=2.0)
    span = max(short.bubble()["makespan_s"], long_.bubble()["makespan_s"])
    fig, axes = plt.subplots(2, 1, figsize=(9, 5), layout="constrained")
    for ax, tl in zip(axes, (short, long_)):
        tl.plot(ax=ax, span=span)
    assert axes[0].get_xlim() == axes[1].get_xlim()
    assert layout_problems(fig) == []
    with pytest.raises(ValueError, match=r"is shorter than the step it draws .* pass the "
                                         r"longest makespan"):
        long_.plot(span=short.bubble()["makespan_s"])
    plt.close("all")


def test_numbers_on_every_bar_a_digit_fits():
    """A bar a few digits wide carries its number: the check uses the Axes' width after the
    layout, not before it (issue 35: most blocks of the tutorial's charts had none)."""
    tl = interleaved(short=0.25)  # bars of 0.25 of 19 s on ~800 px: ~10 px, a digit is ~6
    ax = tl.plot()
    assert len(_texts(ax)) == len(tl.events)
    plt.close(ax.figure)
