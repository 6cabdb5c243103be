"""The harness of the nbdist_shm tests (test_shm_backend*.py): fresh rank processes (``_run``:
spawned.py's ``run_ranks``), rank-side helpers comparing nbdist_shm with gloo, and the check that
no segment is left in /dev/shm."""

import glob
import os
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nbdist.backends import shm  # noqa: E402
from nbdist.backends.shm import segment  # noqa: E402
from spawned import run_ranks as _run  # noqa: E402,F401 -- tests/integration, on sys.path

NAME = "nbdist_shm_t"  # small slots, registered in the ranks
R = dist.ReduceOp
FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int32, torch.int64, torch.uint8, torch.int8]
# Tolerance where the summation order differs from gloo's (3+ ranks; gloo reduces in ring
# order, we in rank order): relative to the magnitude of the inputs (values ~N(0, 1)).
_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _segments():
    return set(glob.glob(os.path.join(segment.SHM_DIR, "nbdist-shm-*")))


@pytest.fixture(autouse=True)
def no_segments_left():
    """Fail a test that leaves a segment of this backend in /dev/shm."""
    before = _segments()
    yield
    left = _segments() - before
    for path in left:
        os.unlink(path)
    assert not left, f"segments left in /dev/shm: {sorted(left)}"


def _init(rank, n, store, timeout=30, name=NAME, slot_bytes=64 << 10):
    assert shm.register(name, slot_bytes=slot_bytes) == name
    assert shm.register(name, slot_bytes=slot_bytes) == name  # idempotent
    dist.init_process_group(name, store=store, rank=rank, world_size=n,
                            timeout=timedelta(seconds=timeout))
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=60))


def _inputs(rank, numel, dtype, op=R.SUM, seed=0):
    """Rank-specific inputs: ~N(0, 1) floats, small ints (no overflow for PRODUCT)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    lo, hi = (-3, 4) if op == R.PRODUCT else (-50, 50)
    if dtype == torch.uint8:
        lo, hi = (0, 4) if op == R.PRODUCT else (0, 256)
    return torch.randint(lo, hi, (numel,), generator=g).to(dtype)


def _same(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (what, a, b)


def _close(ours, ref, exact, what):
    """Bitwise when ``exact``, else within _TOL (relative to the inputs' magnitude ~1)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, what
    if exact or not ours.dtype.is_floating_point:
        assert torch.equal(ours, ref), (what, (ours != ref).sum())
    else:
        tol = _TOL[ours.dtype] * max(1.0, ref.abs().max().item())
        assert torch.allclose(ours.double(), ref.double(), rtol=0, atol=tol), \
            (what, (ours.double() - ref.double()).abs().max())


def _identical_on_all_ranks(t, gloo):
    """Every rank computed the same bits (checked through gloo)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(gloo))]
    dist.all_gather(out, t.contiguous(), group=gloo)
    for o in out:
        _same(o, out[0], "ranks differ")

