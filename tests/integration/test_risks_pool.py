"""A reply the caller cannot unpickle still gives its pooled shared-memory segments back: real ranks,
a class only the ranks can import, segments counted in /dev/shm."""
import glob
import os
import secrets
import sys
import tempfile

import cloudpickle
import pytest

import nbdist
from nbdist.wire import segments

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file

CALLS = 5


@pytest.fixture
def only_on_ranks(group):
    """The name of a module that the ranks can import and this process cannot."""
    name = f"nbdist_only_on_ranks_{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory(prefix="nbdist-risk-mod-") as where:
        with open(os.path.join(where, f"{name}.py"), "w", encoding="utf-8") as f:
            f.write("class OnlyOnRanks:\n    pass\n")
        group.exec(f"import sys; sys.path.insert(0, {where!r})")
        with pytest.raises(ImportError):
            __import__(name)
        yield name


def _result(name, tensor_first):
    """Runs on a rank: a pooled 4 MiB tensor and an object of a class only the ranks have."""
    import importlib

    import torch

    tensor, other = torch.zeros(1 << 20), importlib.import_module(name).OnlyOnRanks()
    return (tensor, other) if tensor_first else (other, tensor)


def _pooled(group, rank):
    return glob.glob(segments.shm_prefix(group.id, f"r{rank}") + "*")


@pytest.mark.parametrize("tensor_first", [
    pytest.param(True, id="tensor-first"),
    pytest.param(False, id="tensor-last"),
])
def test_an_unpicklable_reply_gives_its_pooled_segments_back(group, only_on_ranks, tensor_first):
    for _ in range(CALLS):
        with pytest.raises(nbdist.RemoteError, match="could not be unpickled here"):
            group.run(_result, only_on_ranks, tensor_first)
    assert group.run(lambda: 1) == [1, 1]  # its request carries the last "free" notices
    counts = [len(_pooled(group, r)) for r in range(group.world_size)]
    # Each failed call lends one segment per rank; given back, the next call reuses it.
    assert counts == [1, 1], f"pooled segments per rank after {CALLS} unpicklable replies: {counts}"
