"""The GPU check (``scripts/gpu-check.sh``): nccl and CUDA paths, skipped where there is no CUDA.

No GPU was lent to this project before these tests were written, so each test says what it
measured (lines starting ``GPU-CHECK``, which the script collects) and asserts only what nbdist
promises: the right backend, correct results, formulas met, clear errors in bounded time.

The lent machines have one GPU. NCCL refuses two ranks of one communicator on one device, so there
the nccl group has one rank, and what needs two ranks (parity, a rank that dies or is interrupted
inside a collective, ddp and zero1 memory) runs on ``gpu_pair``: two gloo ranks on CUDA tensors,
sharing the GPU. What only two GPUs can show is not skipped quietly: each such test prints a
``GPU-CHECK ... not covered`` line saying so.
"""
import os

import pytest

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
NO_CUDA = ("no CUDA device here (the GPU check runs on a lent GPU machine: "
           "bash scripts/gpu-check.sh)")


def pytest_collection_modifyitems(config, items):
    """Collected everywhere (so they stay importable), run only where CUDA is."""
    if torch.cuda.is_available():
        return
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def ngpu() -> int:
    return torch.cuda.device_count()


@pytest.fixture(scope="session")
def world(ngpu) -> int:
    """Ranks for the nccl tests: two where there are two GPUs, else one."""
    return 2 if ngpu >= 2 else 1


@pytest.fixture
def two_gpus(ngpu):
    if ngpu < 2:
        pytest.skip(f"needs 2 GPUs (this machine has {ngpu}): one nccl rank per GPU")


@pytest.fixture(scope="module")
def nccl_group(world):
    import nbdist

    with nbdist.start(world, backend="auto", device="cuda", timeout=120) as g:
        yield g


@pytest.fixture(scope="module")
def gpu_pair(ngpu):
    """Two ranks on CUDA tensors: nccl where there are two GPUs, else gloo with both ranks on
    cuda:0 (``max_world_size=2``: nbdist lets ranks beyond the GPUs share them)."""
    import nbdist

    backend = "nccl" if ngpu >= 2 else "gloo"
    with nbdist.start(2, backend=backend, device="cuda", max_world_size=2, timeout=120) as g:
        yield g


os.environ.setdefault("NCCL_DEBUG", "WARN")
