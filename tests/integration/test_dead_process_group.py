"""A collective fails with torch.distributed's timeout or backend error: the process group on the
ranks can no longer be used. The error says so at once, the group becomes "broken", and the next
call says that -- instead of running a collective that blames a rank that did not die.

The groups use a 3 s process-group timeout, so a collective that waits for an idle rank fails fast.
"""
import pytest

import nbdist

pytestmark = pytest.mark.timeout(120)


def _works(group):
    assert group.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]


def test_a_call_that_destroys_the_process_group_and_fails_says_so():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=3) as g:
        with pytest.raises(nbdist.RemoteError) as info:
            g.exec("dist.destroy_process_group()\nif rank == 1: raise RuntimeError('half done')",
                   ranks=[1])
        assert "nbdist: rank 1 no longer has a default process group: this call destroyed it and " \
            "did not make a new one, so collectives fail there until dist.init_process_group " \
            "runs again on every rank; restart() (%dist_restart in a notebook) starts fresh " \
            "ranks." in str(info.value)
        assert g.state == "ready"  # the ranks are fine: a new process group can be made there
        g.restart()
        _works(g)


def test_a_collective_on_a_subset_of_ranks_times_out_and_the_group_says_it_is_broken():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=3) as g:
        with pytest.raises(nbdist.RemoteError) as info:
            g.exec("dist.barrier()", ranks=[1])  # rank 0 never enters it
        message = str(info.value)
        assert info.value.ranks == [1]
        assert "Timed out waiting 3000ms" in message  # torch's own error, as it was
        assert "the process group on the ranks can no longer be used (a collective timed out or " \
               "failed)" in message, message
        assert "call restart() (%dist_restart in a notebook) to start fresh ranks" in message
        assert "this call ran on rank 1 only" in message, message
        assert g.state == "broken"
        with pytest.raises(nbdist.GroupClosedError, match="this group is broken after an earlier "
                                                          "failure .*call restart\\(\\)"):
            g.exec("t = torch.ones(1); dist.all_reduce(t)")
        g.restart()
        _works(g)


def test_with_auto_restart_the_next_call_runs_on_fresh_ranks():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=3, auto_restart=True) as g:
        with pytest.raises(nbdist.RemoteError, match="it restarts on the next call "
                                                     "\\(auto_restart\\)"):
            g.exec("dist.barrier()", ranks=[0])
        assert g.state == "broken"
        _works(g)


@pytest.mark.parametrize("code", [
    "dist.all_reduce(5)",  # a wrong argument: torch refuses it before any rank talks
    "raise RuntimeError('Connection closed by peer, says my own code')",
])
def test_other_errors_near_collectives_leave_the_group_usable(shared_group, code):
    with pytest.raises(nbdist.RemoteError) as info:
        shared_group.exec(code)
    assert "can no longer be used" not in str(info.value)
    assert shared_group.state == "ready"
    _works(shared_group)
