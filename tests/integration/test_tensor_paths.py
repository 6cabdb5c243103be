"""How a local group's large tensors travel (issue 26): shared files beside the message (Linux and
macOS by default) or inside the message (Windows' only way; ``NBDIST_TENSORS=message`` elsewhere,
so the suite runs that path here too). Real groups, 4 MiB each way."""
import pytest
import torch

import nbdist
from nbdist.wire import segments

pytestmark = pytest.mark.timeout(120)


def _segments_of(group):
    return segments.leftover_segments(group.id)


@pytest.mark.parametrize("mode", ["shared", "message"])
def test_push_and_pull_large_tensors_both_ways(mode, monkeypatch):
    monkeypatch.setenv(segments.ENV_VAR, mode)
    with nbdist.start(2, backend="gloo", device="cpu", timeout=30) as g:
        big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
        g.push(x=big)
        back = g.exec("x * (rank + 1)")
        assert [float(t[-1]) for t in back] == [float((1 << 20) - 1) * k for k in (1, 2)]
        kept = _segments_of(g)
        if mode == "message":
            assert kept == []  # nothing on disk at any point: nothing to leak after a kill
        else:
            assert kept  # pooled result segments, kept for reuse while the group runs
        del back
        with pytest.raises(nbdist.RankDiedError):
            g.exec("import os\nif rank == 1: os._exit(9)\nimport time; time.sleep(30)")
        g.restart()
        assert g.run(lambda: 1) == [1, 1]
    assert _segments_of(g) == []


def test_an_unknown_tensor_path_is_refused_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv(segments.ENV_VAR, "files")
    with pytest.raises(ValueError, match=r"NBDIST_TENSORS must be one of 'shared', 'message', "
                                         r"got 'files'; unset it for the default "
                                         r"\('shared'\)\."):
        nbdist.start(2, backend="gloo", device="cpu", timeout=30)


def test_a_reused_result_segment_holds_the_new_bytes():
    """The pull's copy into a pooled segment (memmove from the tensor's first byte): a view that
    starts inside its storage, pulled into a segment freed by the previous pull, arrives exact."""
    with nbdist.start(2, backend="gloo", device="cpu", timeout=30) as g:
        g.exec("base = torch.arange(1 << 19, dtype=torch.float64)")
        for shift in (0, 3, 1000):
            (y,) = g.exec(f"base[{shift}:]", ranks=[0])
            assert y.shape == ((1 << 19) - shift,) and y.dtype == torch.float64
            assert torch.equal(y, torch.arange(shift, 1 << 19, dtype=torch.float64))
            del y  # its segment goes back to rank 0's pool for the next pull
