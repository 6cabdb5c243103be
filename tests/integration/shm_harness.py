"""The harness of the nbdist_shm tests (test_shm_backend*.py): a TCPStore in the pytest process,
ranks spawned with the "spawn" context reporting "ok" or a traceback through it, rank-side
helpers comparing nbdist_shm with gloo, and the check that no segment is left in /dev/shm."""

import faulthandler
import glob
import json
import os
import sys
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nbdist.backends import shm  # noqa: E402
from nbdist.backends.shm import segment  # noqa: E402

HOST = "127.0.0.1"
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


def _entry(fn, rank, world_size, port, prefix, timeout):
    """Child process: connect to the parent's store, run fn, report "ok" or the traceback.

    A rank still running shortly before the parent gives up prints its stacks and exits.
    """
    faulthandler.dump_traceback_later(max(1, timeout - 5), exit=True)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    results = dist.PrefixStore(f"{prefix}/results", store)
    try:
        out = fn(rank, world_size, dist.PrefixStore(prefix, store))
        results.set(str(rank), json.dumps({"ok": out}))
    except BaseException:
        results.set(str(rank), json.dumps({"error": traceback.format_exc()}))
        raise


def _run(fn, world_size, timeout=90, may_die=()):
    """Run fn(rank, world_size, store) in spawned processes; return {rank: fn's result}.

    Fails on any error, except that ranks in ``may_die`` may exit without a result.
    """
    master = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    prefix = f"{fn.__name__}-{time.monotonic_ns()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, master.port, prefix, timeout),
                         daemon=True) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        results = dist.PrefixStore(f"{prefix}/results", master)
        report = {r: json.loads(results.get(str(r))) if results.check([str(r)]) else
                  {"error": f"no result (exit code {p.exitcode})"} for r, p in enumerate(procs)}
        assert not hung, f"ranks {hung} still running after {timeout}s: {report}"
        failed = {r: v["error"] for r, v in report.items() if "error" in v and r not in may_die}
        assert not failed, "\n".join(f"--- rank {r}:\n{m}" for r, m in failed.items())
        return {r: v.get("ok") for r, v in report.items()}
    finally:  # never leave a child behind
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


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

