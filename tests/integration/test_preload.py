"""Group.preload: imports begun on the ranks in a thread of their own (real ranks)."""
import pytest

import nbdist

pytestmark = pytest.mark.timeout(120)


def _imported():
    import sys

    return ["colorsys" in sys.modules, "xml.dom.minidom" in sys.modules]


def test_preload_begins_imports_on_every_rank_and_keeps_the_last_calls_metrics(shared_group):
    g = shared_group
    assert g.run(_imported) == [[False, False]] * 2
    g.exec("import nbdist\nnbdist.log(step=1, loss=0.5)")
    assert len(g.metrics) == 2
    assert g.preload("colorsys", "xml.dom.minidom") is True
    assert len(g.metrics) == 2  # preloading is not "the last call"
    assert g.run(_imported) == [[True, True]] * 2  # imported before this call started
    assert g.preload("colorsys") is True  # done already: no call


def test_a_module_missing_on_the_ranks_is_named_and_the_group_stays_usable(shared_group):
    with pytest.raises(nbdist.RemoteError, match=r"preload: no module named 'no_such_module_x' "
                                                 r"on this rank \(python .*\); install it in the "
                                                 r"ranks' environment, or leave it out"):
        shared_group.preload("json", "no_such_module_x")
    assert shared_group.run(lambda: 1) == [1, 1]


def test_preload_does_nothing_while_a_job_runs(shared_group):
    job = shared_group.submit_exec("import time\ntime.sleep(1.0)")
    assert shared_group.preload("colorsys") is False
    job.result(timeout=30)
