"""Pipelines over 4 ranks (one module-scoped group): GPipe, 1F1B and interleaved match one process
(losses, each stage's gradients and weights; issue 19)."""
import sys

import cloudpickle
import pytest

import nbdist

from test_pipeline import Timeline, check_like_one_process, timed, train

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file
cloudpickle.register_pickle_by_value(sys.modules["test_pipeline"])


@pytest.fixture(scope="module")
def group4():
    g = nbdist.start(4, backend="gloo", device="cpu", timeout=30)
    yield g
    g.stop()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_four_stages_train_like_one_process(group4, schedule):
    out = group4.run(train, schedule, 4)
    check_like_one_process(out)
    assert [r["held"] for r in out] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert out[3]["last"]


def test_interleaved_on_four_ranks_and_its_timeline(group4):
    out = group4.run(train, "interleaved1f1b", 4, layers=8)
    check_like_one_process(out)
    assert [r["stages"] for r in out] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    tl = Timeline.merge(t for t, _, _ in group4.run(timed, "1f1b", 4))
    assert len(tl) == 4 * 4 * 2
    assert tl.bubble()["theory"] == pytest.approx(3 / 7)
