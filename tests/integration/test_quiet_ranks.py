"""Quiet ranks (issue 18) on real groups: a warning every rank prints every step shows once,
labelled with its ranks; per-rank lines still show per rank, in order; nothing is lost."""
import re

import pytest

import nbdist
from stream_paths import each_stream_path

pytestmark = pytest.mark.timeout(120)

STEPS = 8
CELL = f"""
import warnings
warnings.simplefilter("always")  # what floods a cell: the warning is shown at every call
for step in range({STEPS}):
    warnings.warn("old_api is deprecated, use new_api", FutureWarning)
    t = torch.tensor([float(rank + step)])
    dist.all_reduce(t)  # the ranks run in step, as in training
    print(f"step {{step}} loss {{rank + step / 10:.2f}}")
    print("saving checkpoint")
"""
WARNING = re.compile(r"FutureWarning: old_api is deprecated, use new_api$")


def labelled(text):
    """``[(label, line), ...]`` of the ``[label] line`` lines in captured text."""
    return [m.groups() for m in re.finditer(r"^\[([^\]]+)\] (.*)$", text, re.M)]


def test_a_warning_every_step_shows_once_per_cell_with_its_ranks(shared_group, capsys):
    capsys.readouterr()
    shared_group.exec(CELL)
    out, err = capsys.readouterr()
    warnings_shown = [(label, line) for label, line in labelled(err) if WARNING.search(line)]
    assert warnings_shown == [("ranks 0, 1", warnings_shown[0][1]),
                              ("ranks 0, 1: 8 times each", warnings_shown[0][1])]
    assert "nbdist: repeated lines were shown once" in err
    lines = labelled(out)
    for rank in (0, 1):  # every per-rank line, in the order the rank printed it
        mine = [line for label, line in lines if label == f"rank {rank}"]
        assert mine == [f"step {s} loss {rank + s / 10:.2f}" for s in range(STEPS)]
    checkpoints = [label for label, line in lines if line == "saving checkpoint"]
    assert checkpoints[-1] == "ranks 0, 1: 8 times each"  # the summary
    assert len(checkpoints) <= 3  # shown once (once per rank if a rank ran ahead), then counted
    for rank in (0, 1):  # nothing is lost: the group keeps every line
        kept = shared_group.last_output[rank]
        assert sum(1 for line in kept if WARNING.search(line)) == STEPS
        assert kept.count("saving checkpoint") == STEPS


def test_each_call_starts_afresh_and_dedupe_output_false_shows_every_line(shared_group, capsys):
    shared_group.exec("print('hello')")
    shared_group.exec("print('hello')")
    assert labelled(capsys.readouterr().out) == [("ranks 0, 1", "hello"), ("ranks 0, 1", "hello")]
    shared_group.dedupe_output = False
    try:
        shared_group.exec("for _ in range(3): print('again')", ranks=[1])
    finally:
        shared_group.dedupe_output = True
    out, err = capsys.readouterr()
    assert labelled(out) == [("rank 1", "again")] * 3 and "repeated lines" not in err


def test_a_background_job_folds_its_output_and_keeps_all_of_it(shared_group, capsys):
    capsys.readouterr()
    job = shared_group.submit_exec("for i in range(30): print('epoch done')", name="quiet")
    assert job.wait(60)
    job.result()
    out, _ = capsys.readouterr()
    assert [label for label, line in labelled(out) if line == "epoch done"][-1] == \
        "ranks 0, 1: 30 times each"
    assert job.output[0].count("epoch done") == 30 and job.output[1].count("epoch done") == 30
    assert shared_group.last_output is job.call.output


@each_stream_path
def test_a_custom_sink_gets_every_line(streams):
    lines = []
    with nbdist.start(2, backend="gloo", output=lambda r, s, t: lines.extend(t.splitlines()),
                      **streams) as g:
        assert g.dedupe_output
        g.exec("for _ in range(4): print('same')")
    assert lines == ["same"] * 8


def test_dedupe_output_takes_true_or_false(shared_group):
    with pytest.raises(TypeError, match=r"dedupe_output must be True or False, got 'no'"):
        nbdist.start(2, dedupe_output="no")
    with pytest.raises(TypeError, match=r"dedupe_output must be True or False, got 0"):
        shared_group.dedupe_output = 0
    assert shared_group.dedupe_output is True
