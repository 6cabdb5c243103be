"""Large tensors through shared memory on Windows (issue 39): named file mappings instead of files
(nbdist.wire.mappings), pushed mappings reused for the next push of their size once every rank
copied its tensors out, and nothing left behind when a rank is killed holding one. Runs on Linux
too, where the same tests take the /dev/shm files (and no mapping is kept)."""
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
    assert segments.leftover_segments(group.id) == []  # the spare mappings went with the group


def test_large_tensors_travel_through_shared_memory_both_ways(g):
    assert segments.shared_files()  # the default on every platform now
    big = torch.arange(MIB4, dtype=torch.float32)
    g.push(x=big)
    # the push's segment: let go once answered (Windows: kept, for the next push of its size)
    assert segments.leftover_segments(g.id) == mappings.spares(f"nbdist-{g.id}-")
    assert len(mappings.spares(f"nbdist-{g.id}-")) == (1 if mappings.NAMED else 0)
    back = g.exec("x * (rank + 1)")
    assert [float(t[-1]) for t in back] == [float(MIB4 - 1) * k for k in (1, 2)]
    assert [float(t[0] + t[1]) for t in back] == [1.0, 2.0]
    back[0][0] = 7.0  # the caller's own view of rank 0's segment: writable
    assert float(back[0][0]) == 7.0
    del back


def test_pushes_of_one_size_reuse_one_mapping_and_each_rank_keeps_its_own_copy(g):
    prefix = f"nbdist-{g.id}-"
    g.push(x=torch.zeros(MIB4))
    kept = mappings.spares(prefix)
    g.exec("x += rank + 1")  # written on the ranks: their copy, not the mapping
    g.push(y=torch.full((MIB4,), 5.0))  # the same size: into the same mapping (Windows)
    assert mappings.spares(prefix) == kept
    assert g.exec("float(x.sum()), float(y[0]), float(y[-1])") == \
        [(float(MIB4), 5.0, 5.0), (2.0 * MIB4, 5.0, 5.0)]
    g.push(z=torch.ones(MIB4 // 2))  # another size: another mapping, kept beside the first
    assert len(mappings.spares(prefix)) == (2 if mappings.NAMED else 0)
    with pytest.raises(nbdist.RemoteError):  # a call that fails on a rank: its mapping goes
        g.run(lambda t: 1 / 0, torch.ones(MIB4 // 4))
    assert len(mappings.spares(prefix)) == (2 if mappings.NAMED else 0)
    assert g.exec("float(x.sum())") == [float(MIB4), 2.0 * MIB4]


@pytest.mark.skipif(not mappings.NAMED, reason="Windows' named mappings (Linux: /dev/shm files)")
def test_a_spare_mapping_is_reused_only_by_its_own_group_and_size():
    held = segments.shm_prefix("s" * 8, "c") + "held"
    mappings.create(held, 1 << 16)
    assert mappings.reuse(held[:-4], 1 << 16) is None  # held: still in use
    mappings.spare([held])
    assert mappings.reuse(segments.shm_prefix("o" * 8, "c"), 1 << 16) is None  # another group
    assert mappings.reuse(held[:-4], 1 << 17) is None  # another size
    path, buf = mappings.reuse(held[:-4], 1 << 16)
    assert path == held and len(buf) == 1 << 16 and mappings.spares(os.path.basename(held)) == []
    mappings.spare([held])
    mappings.release([held])  # a spare goes like any held mapping
    assert mappings.held(os.path.basename(held)) == []


@pytest.mark.skipif(not mappings.NAMED, reason="Windows' named mappings (Linux: /dev/shm files)")
def test_spares_beyond_the_bound_go_oldest_first(monkeypatch):
    monkeypatch.setattr(mappings, "SPARE_BYTES", 3 << 16)
    names = [segments.shm_prefix("b" * 8, "c") + str(i) for i in range(5)]
    for name in names:
        mappings.create(name, 1 << 16)
    mappings.spare(names)
    assert mappings.spares("nbdist-" + "b" * 8) == names[2:]
    mappings.release(names)
    assert mappings.held("nbdist-" + "b" * 8) == []


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
