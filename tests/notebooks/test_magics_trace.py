"""``%%dist --trace`` on a cell that fails: the user sees the cell's own error, never one from
closing the trace afterwards (a closed group, or a NameError on freshly restarted ranks)."""
from __future__ import annotations

import pytest

import nbdist
from nbdist.errors import RemoteError
from nbdist.ui import magics

from cells import run, texts  # tests/notebooks, on sys.path

DIE = "%%dist --trace\nimport os\nif rank == 1:\n    os._exit(3)"


@pytest.mark.timeout(120)
def test_traced_cell_that_raises_shows_the_remote_error_and_closes_the_trace(shell, dist_group):
    result, captured = run(shell, "%%dist --trace\n"
                                  "t = torch.ones(4)\n"
                                  "dist.all_reduce(t)\n"
                                  "if rank == 1:\n"
                                  "    raise ValueError('boom on rank 1')")
    assert isinstance(result.error_in_exec, RemoteError)
    assert "ValueError: boom on rank 1" in captured.stdout
    assert "During handling" not in captured.stdout
    # the recording stopped on the ranks: a new traced cell records only its own collectives
    _, captured = run(shell, "%%dist --trace -q\nt = torch.ones(4)\ndist.broadcast(t, 0)")
    summary = "".join(texts(captured)[:1])
    assert "broadcast" in summary and "all_reduce" not in summary
    assert texts(run(shell, "%dist rank")[1]) == ["Out[rank 0]: 0", "Out[rank 1]: 1"]


@pytest.mark.timeout(180)
def test_traced_cell_that_kills_a_rank_shows_rank_died(shell, magic_group):
    result, captured = run(shell, DIE)
    assert type(result.error_in_exec).__name__ == "RankDiedError"
    assert "rank 1 exited with code 3" in captured.stdout
    assert "GroupClosedError" not in captured.stdout and "During handling" not in captured.stdout
    _, captured = run(shell, "%dist_restart")
    assert "nbdist: restarted 2 ranks" in captured.stdout
    assert texts(run(shell, "%dist rank")[1]) == ["Out[rank 0]: 0", "Out[rank 1]: 1"]


@pytest.mark.timeout(180)
def test_traced_cell_that_kills_a_rank_of_an_auto_restarting_group(shell, no_group):
    group = nbdist.start(2, backend="gloo", device="cpu", timeout=30, auto_restart=True)
    try:
        magics.use_group(group)
        result, captured = run(shell, DIE)
        assert type(result.error_in_exec).__name__ == "RankDiedError"
        assert "rank 1 exited with code 3" in captured.stdout
        assert "NameError" not in captured.stdout and "During handling" not in captured.stdout
        # the next cell gets fresh ranks (auto_restart), traced or not
        _, captured = run(shell, "%%dist --trace\nt = torch.ones(2)\ndist.all_reduce(t)\nrank")
        assert texts(captured)[:2] == ["Out[rank 0]: 0", "Out[rank 1]: 1"]
    finally:
        magics.use_group(None)
        group.stop()


@pytest.mark.timeout(180)
def test_when_the_recording_cannot_be_stopped_the_cells_error_still_shows(shell, magic_group):
    result, captured = run(shell, "%%dist --trace\n"
                                  "del _nbdist_trace_cm\n"
                                  "raise ValueError('the cell failed')")
    assert isinstance(result.error_in_exec, RemoteError)
    assert "ValueError: the cell failed" in captured.stdout
    assert "nbdist: could not stop the --trace recording on the ranks (RemoteError: NameError" \
        in captured.stderr
    assert "%dist_restart stops it." in captured.stderr
