"""Large tensors through shared memory on Windows (issue 39): named file mappings instead of files
(nbdist.wire.mappings), with nothing left behind when a rank is killed holding one. Runs on Linux
too, where the same tests take the /dev/shm files."""
import os
import sys

import cloudpickle
import pytest
import torch

import nbdist
from nbdist.wire import mappings, segments
from wingroup import windows_group  # tests/windows, on sys.path

pytestmark = pytest.mark.timeout(240)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
MIB4 = 1 << 20  # float32 elements: 4 MiB, above the shared-memory threshold


@pytest.fixture(scope="module")
def g():
    with windows_group() as group:
        yield group


def test_large_tensors_travel_through_shared_memory_both_ways(g):
    assert segments.shared_files()  # the default on every platform now
    big = torch.arange(MIB4, dtype=torch.float32)
    g.push(x=big)
    assert segments.leftover_segments(g.id) == []  # the push's segment: let go once answered
    back = g.exec("x * (rank + 1)")
    assert [float(t[-1]) for t in back] == [float(MIB4 - 1) * k for k in (1, 2)]
    assert [float(t[0] + t[1]) for t in back] == [1.0, 2.0]
    back[0][0] = 7.0  # the caller's own view of rank 0's segment: writable
    assert float(back[0][0]) == 7.0
    del back


@pytest.mark.skipif(not mappings.NAMED, reason="Windows' named mappings (Linux: /dev/shm files)")
def test_a_mapping_nobody_holds_is_refused_not_made_anew():
    name = segments.shm_prefix("t" * 8, "c") + "gone"
    with pytest.raises(FileNotFoundError, match="is gone: the process that made it ended"):
        mappings.open_existing(name, 1 << 16)
    buf = mappings.create(name, 1 << 16)
    buf[:3] = b"abc"
    view = mappings.open_existing(name, 1 << 16, copy=True)
    assert view[:3] == b"abc"
    view[:3] = b"xyz"  # copy-on-write: the maker's bytes stay
    assert buf[:3] == b"abc" and mappings.held(os.path.basename(name)) == [name]
    view.close()
    mappings.release([name])
    assert mappings.held(os.path.basename(name)) == []
    with pytest.raises(FileNotFoundError):
        mappings.open_existing(name, 1 << 16)


@pytest.mark.allow_leaks("the restarted ranks belong to the module's group, stopped at its end")
def test_a_pulled_tensor_outlives_the_rank_that_made_it(g):
    (y,) = g.exec("y = torch.full((1 << 20,), 3.0); y", ranks=[1])
    with pytest.raises(nbdist.RankDiedError):
        g.exec("import os\nif rank == 1: os._exit(9)\nimport time; time.sleep(30)")
    assert float(y.sum()) == 3.0 * MIB4  # our view keeps the memory the dead rank made
    g.restart()
    assert g.run(lambda: 1) == [1, 1]
