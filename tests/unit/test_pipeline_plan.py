"""Pipelines without processes: how a model is split, the bubble's arithmetic, the Gantt chart."""
import pickle

import pytest

from nbdist.parallel import Timeline
from nbdist.parallel._timeline import theory
from nbdist.parallel.pipeline import plan

pytestmark = pytest.mark.timeout(60)


def test_even_split_by_layer_count_earlier_stages_take_the_extra_layers():
    assert plan(8, 2, "1f1b", 4) == [(0, 4), (4, 8)]
    assert plan(7, 3, "gpipe", 1) == [(0, 3), (3, 5), (5, 7)]
    assert plan(8, 2, "interleaved1f1b", 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert plan(6, 3, "GPipe", 2, split=[1, 5]) == [(0, 1), (1, 5), (5, 6)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(microbatches=0), "microbatches must be an int >= 1, got 0"),
    (dict(schedule="gpipe", stages_per_rank=2),
     "schedule 'gpipe' runs one stage per rank, got stages_per_rank=2; use "
     "schedule='interleaved1f1b' for several"),
    (dict(split=(0,)), r"split=\(0,\) is not valid"),
    (dict(split="2"), "split='2' is not valid"),
])
def test_plan_refuses(kwargs, message):
    args = dict(num_layers=8, ranks=2, schedule="1f1b", microbatches=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan(**args)


def ideal_gpipe(p, m, t=1.0):
    """GPipe with every forward and backward taking ``t`` and free communication."""
    events = []
    for r in range(p):
        for i in range(m):
            events.append(dict(rank=r, stage=r, microbatch=i, kind="forward",
                               start=(r + i) * t, end=(r + i + 1) * t))
            b = m + p - 1 + (p - 1 - r) + i
            events.append(dict(rank=r, stage=r, microbatch=i, kind="backward",
                               start=b * t, end=(b + 1) * t))
    return [Timeline("gpipe", m, p, p, [e for e in events if e["rank"] == r],
                     {r: (0.0, 2 * (m + p - 1) * t)}) for r in range(p)]


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_an_ideal_schedule_measures_its_theory(p, m):
    tl = Timeline.merge(pickle.loads(pickle.dumps(t)) for t in ideal_gpipe(p, m))  # plain data
    b = tl.bubble()
    assert b["measured"] == pytest.approx((p - 1) / (m + p - 1))
    assert b["measured"] == pytest.approx(b["theory"])
    assert set(b["per_rank"]) == set(range(p)) and b["makespan_s"] == 2 * (m + p - 1)
    rows = tl.rows()
    assert [r["busy_s"] for r in rows] == [2.0 * m] * p
    assert rows[0]["forward_s"] == rows[0]["backward_s"] == 1.0
    assert f"theory {(p - 1) / (m + p - 1):.1%}: (p-1)/(m+p-1)" in tl.table().text()


def one_f_one_b(m=4):
    """Two ranks under 1F1B, every event 1 long: rank 0 runs two forwards before its first
    backward, rank 1 (the last stage) alternates from the start."""
    order = {0: "f0 f1 b0 f2 b1 f3 b2 b3", 1: "f0 b0 f1 b1 f2 b2 f3 b3"}
    parts = []
    for r, ops in order.items():
        events = [dict(rank=r, stage=r, microbatch=int(op[1]),
                       kind="forward" if op[0] == "f" else "backward", start=float(i),
                       end=i + 1.0) for i, op in enumerate(ops.split())]
        parts.append(Timeline("1f1b", m, 2, 2, events, {r: (0.0, 2.0 * m)}))
    return Timeline.merge(parts)


def test_peak_activations_in_flight_follow_the_order_of_events():
    assert Timeline.merge(ideal_gpipe(4, 8)).in_flight() == {0: 8, 1: 8, 2: 8, 3: 8}
    tl = one_f_one_b()
    assert tl.in_flight() == {0: 2, 1: 1}  # p - rank
    assert [r["in_flight"] for r in tl.rows()] == [2, 1]
    assert "peak in flight (microbatches)" in tl.table().text()


def spread(tl, gap):
    """The same step with ``gap`` of waiting (a slow send) before every event."""
    for r in {e["rank"] for e in tl.events}:
        for n, e in enumerate(sorted((e for e in tl.events if e["rank"] == r),
                                     key=lambda e: e["start"])):
            e["start"] += n * gap
            e["end"] += n * gap
    return tl


def interleaved_torch_order():
    """Rank r runs stages r and r + 2, in the order torch's Interleaved1F1B gives for p=2,
    m=4; a forward takes 1, a backward 2."""
    order = {0: "F00 F01 F20 F21 F02 B20 F03 B21 F22 B00 F23 B01 B22 B23 B02 B03",
             1: "F10 F11 F30 B30 F31 B31 F12 B10 F13 B11 F32 B32 F33 B33 B12 B13"}
    parts = []
    for r, ops in order.items():
        t, events = 0.0, []
        for op in ops.split():
            took = 1.0 if op[0] == "F" else 2.0
            events.append(dict(rank=r, stage=int(op[1]), microbatch=int(op[2]),
                               kind="forward" if op[0] == "F" else "backward", start=t,
                               end=t + took))
            t += took
        parts.append(Timeline("interleaved1f1b", 4, 2, 4, events, {r: (0.0, t)}))
    return Timeline.merge(parts)


def test_replay_gives_the_order_s_own_bubble_without_the_waits():
    tl = spread(one_f_one_b(), gap=3.0)  # every event after 3 of waiting: measured >> theory
    assert tl.bubble()["measured"] > 0.6
    assert tl.replay()["bubble"] == pytest.approx(1 / 5) and tl.replay()["makespan_s"] == 10
    assert Timeline.merge(ideal_gpipe(4, 8)).replay()["bubble"] == pytest.approx(3 / 11)
    slow = one_f_one_b()
    slow.events[0]["end"] += 50.0  # one preempted forward: the median ignores it
    assert slow.replay()["bubble"] == pytest.approx(1 / 5)
    assert one_f_one_b().replay(times_from=[slow, one_f_one_b()])["bubble"] == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="replay\\(\\): times_from has no forward of stage 0"):
        one_f_one_b().replay(times_from=[Timeline(
            "1f1b", 4, 2, 2, [e for e in one_f_one_b().events if e["stage"] == 1])])
    mixed = interleaved_torch_order()
    assert mixed.replay()["bubble"] == pytest.approx(1 / 9) == mixed.bubble()["theory"]
    mixed.events = [e for e in mixed.events if (e["stage"], e["kind"]) != (1, "forward")]
    with pytest.raises(ValueError, match="replay\\(\\): the recorded events do not form one"):
        mixed.replay()


def test_theory_of_each_schedule():
    assert theory("1f1b", 8, 2)[0] == pytest.approx(1 / 9)
    value, formula = theory("interleaved1f1b", 4, 2, 2)
    assert value == pytest.approx(1 / 9) and formula.startswith("(p-1)/(v*m+p-1) = 1/9")


def test_merge_refuses_what_is_not_a_timeline_of_the_same_pipeline():
    a, b = ideal_gpipe(2, 4)
    with pytest.raises(TypeError, match="Timeline.merge\\(\\) takes Timeline objects .* got dict"):
        Timeline.merge([a, {}])
    with pytest.raises(ValueError, match="cannot merge timelines of different pipelines: "
                                         "gpipe/m=4 and 1f1b/m=4"):
        Timeline.merge([a, Timeline("1f1b", 4, 2, 2)])
    with pytest.raises(ValueError, match="this timeline has no events"):
        Timeline("1f1b", 4, 2, 2).bubble()
    with pytest.raises(ValueError, match="Timeline.merge\\(\\) needs at least one Timeline"):
        Timeline.merge([None, None])  # ranks that returned nothing


def test_gantt_chart_draws_a_bar_per_forward_and_backward():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = Timeline.merge(ideal_gpipe(2, 4))
    ax = tl.plot()
    assert len(ax.patches) == 16
    assert ax.get_title(loc="left") == ("gpipe, m=4, p=2: step 10000 ms, bubble 20% measured, 20% "
                                        "in theory")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="plot_pipeline\\(\\) got a timeline without events"):
        Timeline("1f1b", 4, 2, 2).plot()


def test_the_pp_estimate_is_the_stage_s_layers():
    from nbdist.memory import estimate, estimate_table

    e = estimate(1000, 4, "pp", optimizer="adam")
    assert (e.params, e.grads, e.optimizer_state) == (1000, 1000, 2000)  # 250 parameters each
    assert e.formula.startswith("PP: the stage's layers: (P + G + K)Ψ_stage = 16Ψ_stage")
    assert "an even split over N ranks: Ψ_stage ≈ Ψ/N" in e.formula
    assert "pp        PP" in str(estimate_table(1000, 4, ["pp"]))
