"""How many torch threads each rank gets: the cores this process may run on, not the machine's."""
import os

import pytest

from nbdist.runtime import current
from nbdist.runtime.launcher import threads_per_rank

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity: Linux")


@pytest.fixture
def one_core(monkeypatch):
    """This process pinned to one of its cores (as taskset -c 0 would), for the test."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(current, "_notes_said", set())
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    yield
    os.sched_setaffinity(0, allowed)


def test_threads_per_rank_counts_the_cores_this_process_may_use(one_core, capsys):
    assert threads_per_rank({"threads": None, "env": None, "world_size": 2}) == 1
    said = capsys.readouterr()
    assert "torch uses 1 thread per rank (1 core shared by 2 ranks)" in said.out
    assert not said.err  # a note, not an error: Jupyter shows stderr in a pink box
