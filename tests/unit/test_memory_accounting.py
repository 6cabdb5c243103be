"""The memory walk's bookkeeping on one process: which storages count as new, who holds the few
bytes of "other"."""
import pytest
import torch

from nbdist.memory import accounting

pytestmark = pytest.mark.timeout(30)


def test_a_storage_freed_after_the_snapshot_is_not_known_even_at_the_same_address():
    old = torch.ones(1 << 18)
    snapshot = accounting._snapshot()
    key = accounting._key(old)
    assert key in accounting._alive(snapshot)
    del old
    new = torch.ones(1 << 18)  # the allocator often puts it where the old one was
    assert accounting._key(new) not in accounting._alive(snapshot)
    assert accounting._key(new) == key or key not in accounting._alive(snapshot)


class _Mesh:
    def __init__(self):
        self.ranks = torch.tensor([0, 1], dtype=torch.int32)


def test_the_holder_of_a_few_bytes_is_named():
    holder = _Mesh()
    assert accounting._owners({accounting._key(holder.ranks)}) == ["_Mesh.ranks (8 B)"]
