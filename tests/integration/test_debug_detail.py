"""``start(debug="detail")`` (issue 27): torch's own TORCH_DISTRIBUTED_DEBUG=DETAIL checks on the
ranks, a mismatch they find surfaced as a clear RemoteError that names each rank's call; a bad
value refused before any rank starts."""
import pytest

import nbdist
from nbdist.runtime import current
from nbdist.runtime.status import DETAIL_NOTE

pytestmark = pytest.mark.timeout(120)

MISMATCH = """t = torch.ones(1024) if rank == 0 else torch.ones(10)
if rank == 0:
    dist.all_reduce(t)
else:
    dist.broadcast(t, 0)
"""


def test_detail_names_mismatched_collectives_and_the_group_survives():
    with nbdist.start(2, debug="detail", timeout=10) as g:
        assert DETAIL_NOTE in current._notes_said  # said once: the cost, and DDP's crash
        assert g.exec("import os; os.environ['TORCH_DISTRIBUTED_DEBUG']") == ["DETAIL"] * 2
        with pytest.raises(nbdist.RemoteError) as info:
            g.exec(MISMATCH)
        text = str(info.value)
        assert text.startswith("RuntimeError on ranks 0, 1: Detected mismatch between "
                               "collectives on ranks. Rank "), text
        # torch's fingerprints: each rank named, with its op and shape (the root cause is
        # whichever rank's failure came first, and its message names itself first)
        assert "Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=0, " \
               "OpType=ALLREDUCE, TensorShape=[1024], TensorDtypes=Float" in text
        assert "Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=0, " \
               "OpType=BROADCAST, TensorShape=[10], TensorDtypes=Float" in text
        assert "nbdist: The ranks ran different collectives" in text  # the plain-words hint
        assert g.state == "ready"
        assert g.exec("t = torch.ones(2); dist.all_reduce(t); t.sum().item()") == [4.0, 4.0]


@pytest.mark.parametrize("value", ["nope", "DETAILS", 1, "on"])
def test_a_bad_debug_value_is_refused_before_anything_starts(value):
    with pytest.raises(ValueError) as info:
        nbdist.start(2, debug=value)
    assert str(info.value) == (
        f"debug= got {value!r}; accepted: 'detail' (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL: "
        "collectives checked across ranks, a mismatch named) or 'off' (the default); True and "
        "False mean the same")
    # the suite's leak check (tests/conftest.py) sees that no worker was left behind


def test_off_and_the_bool_aliases_set_nothing_or_detail():
    from nbdist.runtime.status import debug_env

    assert debug_env("off") == debug_env(False) == debug_env(None) == {}
    assert debug_env("detail") == debug_env("DETAIL") == debug_env(True) == \
        {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def test_ddp_under_detail_crashes_every_rank_as_the_start_note_says():
    """torch 2.13's DETAIL wrapper with DDP on gloo: SIGSEGV in the first backward pass (plain
    torch.multiprocessing.spawn too). Pinned so that the note and the docs change when torch's
    behaviour does."""
    with nbdist.start(2, debug="detail", timeout=20) as g:
        with pytest.raises(nbdist.RankDiedError) as info:
            g.exec("m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))\n"
                   "m(torch.ones(2, 4)).sum().backward()")
        assert "rank 0 was killed by SIGSEGV (exit code -11); rank 1 was killed by SIGSEGV" in \
            str(info.value)
