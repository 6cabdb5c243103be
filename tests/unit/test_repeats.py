"""Quiet ranks: the folding rules of nbdist.wire.repeats, on lines and times given by the test."""
import warnings

import pytest

from nbdist.wire.repeats import WINDOW, RepeatFolder, rank_label


def shown(items):
    """``[(label, stream, text), ...]`` of what a folder returned."""
    return [(s.label, s.stream, s.text) for s in items]


def real_warning(message, lineno=12):
    """The text Python's warnings module writes for a FutureWarning (two lines)."""
    return warnings.formatwarning(message, FutureWarning, "/site/torch/x.py", lineno,
                                  "    warnings.warn(").rstrip("\n")


@pytest.mark.parametrize("ranks, label", [
    ([3], "rank 3"), ([1, 0], "ranks 0, 1"), ([0, 1, 2, 3], "ranks 0-3"),
    ([0, 1, 2, 3, 6, 8, 9], "ranks 0-3, 6, 8, 9"), ([5, 6, 7, 0], "ranks 0, 5-7"),
])
def test_rank_labels_write_runs_of_three_or_more_as_ranges(ranks, label):
    assert rank_label(ranks) == label


def test_the_same_line_from_every_rank_within_the_window_shows_once_with_its_ranks():
    f = RepeatFolder()
    assert f.feed(0, "stdout", "hello", 0.0) == []  # held: the other ranks may print it too
    assert f.feed(1, "stdout", "hello", 0.01) == []
    assert f.feed(2, "stdout", "hello", 0.02) == []
    assert f.next_due(0.05) == pytest.approx(WINDOW - 0.05)
    assert shown(f.due(WINDOW)) == [("ranks 0-2", "stdout", "hello")]
    assert f.next_due(1.0) is None
    assert f.finish() == ([], [])  # nothing was folded: no summary


def test_lines_that_differ_per_rank_show_per_rank_in_order():
    f = RepeatFolder()
    for step in range(3):
        t = step * 0.01
        f.feed(0, "stdout", f"step {step} loss {1.0 - step / 10:.2f}", t)
        f.feed(1, "stdout", f"step {step} loss {2.0 - step / 10:.2f}", t)
    out = shown(f.due(1.0))
    assert out == [("rank 0", "stdout", "step 0 loss 1.00"), ("rank 1", "stdout", "step 0 loss 2.00"),
                   ("rank 0", "stdout", "step 1 loss 0.90"), ("rank 1", "stdout", "step 1 loss 1.90"),
                   ("rank 0", "stdout", "step 2 loss 0.80"), ("rank 1", "stdout", "step 2 loss 1.80")]
    assert f.finish() == ([], [])


def test_a_warning_every_step_on_every_rank_shows_once_and_the_summary_counts_it():
    f = RepeatFolder()
    warning = real_warning("old_api is deprecated")
    assert warning.count("\n") == 1  # header + the source line, as Python prints it
    seen = []
    for step in range(20):
        for rank in range(4):
            t = step * 1.0 + rank * 0.001
            seen += f.feed(rank, "stderr", warning, t)
            seen += f.feed(rank, "stdout", f"rank {rank} step {step}", t)
    held, summary = f.finish()
    seen += held
    lines = shown(seen)
    assert lines.count(("ranks 0-3", "stderr", warning.split("\n")[0])) == 1
    assert lines.count(("ranks 0-3", "stderr", warning.split("\n")[1])) == 1
    assert sum(1 for _, stream, _ in lines if stream == "stderr") == 2
    assert sum(1 for _, stream, _ in lines if stream == "stdout") == 80  # every per-rank line
    assert shown(summary) == [("ranks 0-3: 20 times each", "stderr", warning.split("\n")[0]),
                              ("ranks 0-3: 20 times each", "stderr", warning.split("\n")[1])]
    assert summary[0].render() == f"[ranks 0-3: 20 times each] {warning.splitlines()[0]}\n"


def test_a_line_a_rank_repeats_shows_once_and_the_summary_says_how_often():
    f = RepeatFolder()
    out = []
    for i in range(5):
        out += f.feed(0, "stdout", "saving checkpoint", i * 1.0)
    held, summary = f.finish()
    assert shown(out + held) == [("rank 0", "stdout", "saving checkpoint")]
    assert shown(summary) == [("rank 0: 5 times", "stdout", "saving checkpoint")]
    assert f.folded() == 0  # finish started over


def test_two_different_warnings_keep_their_own_source_lines():
    f = RepeatFolder()
    first, second = real_warning("a is deprecated"), real_warning("b is deprecated", 40)
    out = f.feed(0, "stderr", first, 0.0) + f.feed(0, "stderr", second, 0.0) + f.due(1.0)
    assert "\n".join(text for _, _, text in shown(out)) == first + "\n" + second


def test_a_folded_block_that_turns_out_different_shows_its_head_with_the_new_line():
    f = RepeatFolder(window=0.0)
    out = f.feed(0, "stderr", "Traceback:\n  frame a\n  frame b\nError: x", 0.0)
    assert len(out) == 4
    again = f.feed(0, "stderr", "Traceback:\n  frame a\n  frame c\nError: x", 1.0)
    assert shown(again) == [("rank 0", "stderr", "Traceback:\n  frame a\n  frame c")]


def test_the_same_line_on_two_streams_is_two_lines():
    f = RepeatFolder()
    f.feed(0, "stdout", "x", 0.0)
    f.feed(1, "stderr", "x", 0.0)
    assert sorted(shown(f.due(1.0))) == [("rank 0", "stdout", "x"), ("rank 1", "stderr", "x")]


def test_joining_another_ranks_line_never_reorders_a_rank():
    f = RepeatFolder()
    f.feed(0, "stdout", "loss 0.1", 0.0)
    f.feed(0, "stdout", "saving", 0.0)       # held after rank 0's loss line
    f.feed(1, "stdout", "loss 0.2", 0.01)    # rank 1's own line, after rank 0's "saving"
    f.feed(1, "stdout", "saving", 0.02)      # "saving" moves after it, and shows once
    assert shown(f.due(1.0)) == [("rank 0", "stdout", "loss 0.1"), ("rank 1", "stdout", "loss 0.2"),
                                 ("ranks 0, 1", "stdout", "saving")]
    g = RepeatFolder()
    g.feed(0, "stdout", "saving", 0.0)
    g.feed(0, "stdout", "loss 0.1", 0.0)     # rank 0 went on: "saving" can no longer move
    g.feed(1, "stdout", "loss 0.2", 0.01)
    g.feed(1, "stdout", "saving", 0.02)
    out = shown(g.due(1.0))
    assert out == [("rank 0", "stdout", "saving"), ("rank 0", "stdout", "loss 0.1"),
                   ("rank 1", "stdout", "loss 0.2"), ("rank 1", "stdout", "saving")]
    assert shown(g.finish()[1]) == []  # each copy was shown: nothing to summarise


def test_order_is_kept_per_stream_so_a_print_that_overtakes_a_warning_does_not_split_it():
    # stdout and stderr reach the kernel separately: rank 1's print can arrive before the warning
    # it wrote first. The warning still shows once, for both ranks (CI once saw it shown twice).
    f = RepeatFolder()
    warning = real_warning("old_api is deprecated")
    f.feed(0, "stderr", warning, 0.0)
    f.feed(0, "stdout", "loss 0", 0.0)
    f.feed(1, "stdout", "loss 10", 0.01)
    f.feed(1, "stderr", warning, 0.02)
    out = shown(f.due(1.0))
    assert [s for s in out if s[1] == "stderr"] == [("ranks 0, 1", "stderr", line)
                                                    for line in warning.split("\n")]
    assert [s for s in out if s[1] == "stdout"] == [("rank 0", "stdout", "loss 0"),
                                                    ("rank 1", "stdout", "loss 10")]


def test_unequal_counts_are_summed_in_the_summary():
    f = RepeatFolder(window=0.0)
    for rank, times in ((0, 3), (1, 2)):
        for i in range(times):
            f.feed(rank, "stdout", "tick", float(i))
    assert shown(f.finish()[1]) == [("ranks 0, 1: 5 times", "stdout", "tick")]


def test_beyond_max_lines_new_lines_show_and_are_not_remembered():
    f = RepeatFolder(window=0.0, max_lines=2)
    out = []
    for text in ("a", "b", "c", "c", "a"):
        out += f.feed(0, "stdout", text, 0.0)
    assert [t for _, _, t in shown(out)] == ["a", "b", "c", "c"]
    assert shown(f.finish()[1]) == [("rank 0: 2 times", "stdout", "a")]


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError, match="window must be >= 0 seconds, got -1"):
        RepeatFolder(window=-1)


def test_torchs_rank_labelled_warnings_fold_across_ranks_and_steps():
    """Issue 27: torch's log lines differ per rank only in "[rankN]:", the time and the pid."""
    f = RepeatFolder()
    w = "ProcessGroupGloo.cpp:514] Warning: the collective is slow (function operator())"
    f.feed(0, "stderr", f"[rank0]:[W1204 10:11:12.345678 4242 {w}", 0.0)
    f.feed(1, "stderr", f"[rank1]:[W1204 10:11:12.351234 4243 {w}", 0.01)
    f.feed(0, "stderr", "W1204 10:11:12.400000 4242 torch/distributed/x.py:7] python-side", 0.02)
    f.feed(1, "stderr", "W1204 10:11:12.410000 4243 torch/distributed/x.py:7] python-side", 0.03)
    assert shown(f.due(1.0)) == [
        ("ranks 0, 1", "stderr", f"[W1204 10:11:12.345678 4242 {w}"),
        ("ranks 0, 1", "stderr", "W1204 10:11:12.400000 4242 torch/distributed/x.py:7] python-side")]
    for step in range(5):  # the same warning every step: counted, not shown again
        for rank in (0, 1):
            f.feed(rank, "stderr", f"[rank{rank}]:[W1204 10:11:{13 + step}.000001 {4242 + rank} {w}",
                   1.1 + step)
    assert f.due(10.0) == []
    _, summary = f.finish()
    assert shown(summary)[0] == ("ranks 0, 1: 6 times each", "stderr",
                                 f"[W1204 10:11:12.345678 4242 {w}")
