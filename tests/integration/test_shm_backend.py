"""Integration tests for the nbdist_shm backend (nbdist.shm), with real spawned processes.

Multi-process tests host a TCPStore in the pytest process, spawn the ranks with the
multiprocessing "spawn" context and collect one result string per rank through that store
("ok" or a traceback). Each rank checks every collective against gloo on the same inputs
(a gloo group of the same ranks): bitwise where the reduction order allows it, else with the
tolerance stated at ``_TOL``. Many checks share one spawned run to keep the file fast. Small
slots (``slot_bytes=64 KiB``) make modest tensors move in many chunks. Every test checks that
no ``/dev/shm/nbdist-shm-*`` segment is left behind; the suite's conftest checks for leaked
child processes.
"""

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
import nbdist  # noqa: E402
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


# ----------------------------------------------------------------------------- harness
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


# ------------------------------------------------------------------------------ suites
def _reductions(rank, n, gloo, group):
    """all_reduce, reduce, reduce_scatter against gloo on one group."""
    exact_order = n == 2  # a + b == b + a: no ordering difference with 2 ranks
    cases = [(d, op) for d in FLOATS for op in (R.SUM, R.AVG, R.MAX, R.MIN, R.PRODUCT)]
    cases += [(d, op) for d in INTS for op in (R.SUM, R.MAX, R.MIN, R.PRODUCT)]
    for i, (dtype, op) in enumerate(cases):
        for numel in (1, 7, 70_001):  # 70_001 x 4 bytes: past SMALL_BYTES, in many chunks
            x = _inputs(rank, numel, dtype, op, seed=i)
            ours, ref = x.clone(), x.clone()
            dist.all_reduce(ours, op=op, group=group)
            dist.all_reduce(ref, op=op, group=gloo)
            exact = exact_order or op in (R.MAX, R.MIN)
            _close(ours, ref, exact, f"all_reduce {dtype} {op} {numel}")
            if numel == 70_001:
                _identical_on_all_ranks(ours, gloo)
    # non-contiguous (a transposed view), and an empty tensor
    x = _inputs(rank, 600, torch.float32).view(20, 30).t()
    ours, ref = x.clone().t().contiguous().t(), x.contiguous()
    assert not ours.is_contiguous()
    dist.all_reduce(ours, group=group)
    dist.all_reduce(ref, group=gloo)
    _close(ours, ref, exact_order, "non-contiguous all_reduce")
    empty = torch.zeros(0)
    dist.all_reduce(empty, group=group)
    # reduce to every root
    for root in range(n):
        x = _inputs(rank, 70_001, torch.float32, seed=root)
        ours, ref = x.clone(), x.clone()
        dist.reduce(ours, dst=dist.get_global_rank(group, root), group=group)
        dist.reduce(ref, dst=root, group=gloo)
        if rank == root:
            _close(ours, ref, exact_order, "reduce")
        for small in (True, False):
            y = _inputs(rank, 5 if small else 70_001, torch.int64, seed=root)
            want = sum(_inputs(r, y.numel(), torch.int64, seed=root) for r in range(n))
            dist.reduce(y, dst=dist.get_global_rank(group, root), group=group)
            if rank == root:
                _same(y, want, "reduce int")
    # reduce_scatter_tensor (large, chunked) and the list form
    for op in (R.SUM, R.AVG, R.MAX):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            if op == R.AVG and dtype == torch.int64:
                continue
            inp = _inputs(rank, 20_001 * n, dtype)
            ours, ref = torch.empty(20_001, dtype=dtype), torch.empty(20_001, dtype=dtype)
            dist.reduce_scatter_tensor(ours, inp, op=op, group=group)
            dist.reduce_scatter_tensor(ref, inp, op=op, group=gloo)
            _close(ours, ref, exact_order or op == R.MAX, f"reduce_scatter_tensor {op} {dtype}")
    ins = [_inputs(rank, 9, torch.float32, seed=d) for d in range(n)]
    ours, ref = torch.empty(9), torch.empty(9)
    dist.reduce_scatter(ours, ins, group=group)
    dist.reduce_scatter(ref, ins, group=gloo)
    _close(ours, ref, exact_order, "reduce_scatter list")


def _movement(rank, n, gloo, group):
    """broadcast, all_gather, all_to_all, barrier against gloo / expected values."""
    for root in range(n):
        src = dist.get_global_rank(group, root)
        for dtype, numel in ((torch.float32, 100_003), (torch.bool, 33), (torch.int64, 0)):
            x = _inputs(rank, numel, torch.float32, seed=root) > 0 if dtype == torch.bool \
                else _inputs(rank, numel, dtype, seed=root)
            want = _inputs(root, numel, torch.float32, seed=root) > 0 if dtype == torch.bool \
                else _inputs(root, numel, dtype, seed=root)
            dist.broadcast(x, src=src, group=group)
            _same(x, want, "broadcast")
        mine = _inputs(rank, 1200, torch.float32).view(30, 40)
        y = mine if rank == root else torch.zeros(40, 30).t()  # non-contiguous receivers
        dist.broadcast(y, src=src, group=group)
        _same(y.contiguous(), _inputs(root, 1200, torch.float32).view(30, 40), "broadcast nc")
    # all_gather: list (equal and uneven sizes), into one tensor, coalesced
    x = _inputs(rank, 30_001, torch.float16)
    ours = [torch.empty_like(x) for _ in range(n)]
    ref = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(ours, x, group=group)
    dist.all_gather(ref, x, group=gloo)
    for a, b in zip(ours, ref):
        _same(a, b, "all_gather")
    ours = [torch.empty(r * 7 + 1, dtype=torch.int32) for r in range(n)]
    dist.all_gather(ours, torch.full((rank * 7 + 1,), rank, dtype=torch.int32), group=group)
    for r in range(n):
        _same(ours[r], torch.full((r * 7 + 1,), r, dtype=torch.int32), "uneven all_gather")
    x = _inputs(rank, 600, torch.float32).view(20, 30).t()  # non-contiguous input
    ours, ref = torch.empty(n * 30, 20), torch.empty(n * 30, 20)
    dist.all_gather_into_tensor(ours, x, group=group)
    dist.all_gather_into_tensor(ref, x.contiguous(), group=gloo)
    _same(ours, ref, "all_gather_into_tensor")
    outs = [[torch.empty(3), torch.empty(2)] for _ in range(n)]
    dist.all_gather_coalesced(outs, [torch.full((3,), float(rank)), torch.tensor([rank, -rank])
                                     .float()], group=group)
    for r in range(n):
        _same(outs[r][0], torch.full((3,), float(r)), "all_gather_coalesced")
        _same(outs[r][1], torch.tensor([r, -r]).float(), "all_gather_coalesced")
    # all_to_all_single: even, uneven (rank s sends d+1 rows of 5 to rank d), list form
    inp = _inputs(rank, n * 40_000, torch.float32)
    ours, ref = torch.empty_like(inp), torch.empty_like(inp)
    dist.all_to_all_single(ours, inp, group=group)
    dist.all_to_all_single(ref, inp, group=gloo)
    _same(ours, ref, "all_to_all_single")
    in_splits = [d + 1 for d in range(n)]
    inp = _inputs(rank, sum(in_splits) * 5, torch.int64).view(-1, 5)
    ours, ref = (torch.empty((rank + 1) * n, 5, dtype=torch.int64) for _ in range(2))
    dist.all_to_all_single(ours, inp, [rank + 1] * n, in_splits, group=group)
    dist.all_to_all_single(ref, inp, [rank + 1] * n, in_splits, group=gloo)
    _same(ours, ref, "uneven all_to_all_single")
    ins = [_inputs(rank, 4, torch.float32, seed=d) for d in range(n)]
    ours, ref = [torch.empty(4) for _ in range(n)], [torch.empty(4) for _ in range(n)]
    dist.all_to_all(ours, ins, group=group)
    dist.all_to_all(ref, ins, group=gloo)
    for a, b in zip(ours, ref):
        _same(a, b, "all_to_all")
    dist.barrier(group=group)


def _refusals(rank, n, group):
    """What the backend lacks raises a clear error on every rank; the group stays usable."""
    x = torch.ones(4)
    cases = [
        (lambda: dist.gather(x, [torch.empty(4) for _ in range(n)] if rank == 0 else None,
                             dst=0, group=group), "does not support gather"),
        (lambda: dist.scatter(x, [x] * n if rank == 0 else None, src=0, group=group),
         "does not support scatter"),
        (lambda: dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0), group=group),
         "all_reduce with reduce op"),
        (lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64), op=R.AVG, group=group),
         "all_reduce with AVG on torch.int64 tensors"),
        (lambda: dist.all_reduce(torch.ones(3), op=R.BAND, group=group),
         "all_reduce with BAND on torch.float32"),
        (lambda: dist.all_reduce(torch.ones(3, device="meta"), group=group),
         "dense CPU tensors only"),
    ]
    if rank < 2:  # point-to-point between ranks 0 and 1
        peer = dist.get_global_rank(group, 1 - rank)
        cases.append((lambda: dist.send(x, dst=peer, group=group) if rank == 0 else
                      dist.recv(x, src=peer, group=group), r"(send|recv) \(point-to-point\)"))
    for call, text in cases:
        with pytest.raises(shm.ShmUnsupportedError, match=text):
            call()
    y = torch.full((5,), float(rank))
    dist.all_reduce(y, group=group)
    _same(y, torch.full((5,), float(n * (n - 1) / 2)), "usable after refusals")


def _collectives(rank, n, store):
    """Every supported op, on the default group and on subgroups used interleaved."""
    import torch.distributed._functional_collectives as funcol

    gloo = _init(rank, n, store)
    world = dist.group.WORLD
    assert isinstance(world, shm.ShmProcessGroup) and world.name() == NAME
    assert dist.get_backend() == NAME
    _reductions(rank, n, gloo, world)
    _movement(rank, n, gloo, world)
    _refusals(rank, n, world)

    # async_op=True
    t = torch.full((3,), rank + 1.0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert work.is_completed() and work.is_success()
    _same(work.get_future().value()[0], torch.full((3,), n * (n + 1) / 2), "async")

    # many groups at once: each has its own segment; use them interleaved
    pair = dist.new_group([0, 1], backend=NAME)
    tail = dist.new_group(list(range(1, n)), backend=NAME)
    big = dist.new_group(backend=shm.register())  # "nbdist_shm": the default 32 MiB slots
    mine = [g for g in (world, pair, tail, big) if g is not dist.GroupMember.NON_GROUP_MEMBER]
    paths = [g._seg.path for g in mine]
    assert len(set(paths)) == len(paths)
    for i in range(3):
        for g in mine:
            v = torch.full((1000,), float(rank + i))
            dist.all_reduce(v, group=g)
            ranks = dist.get_process_group_ranks(g)
            _same(v, torch.full((1000,), float(sum(r + i for r in ranks))), "many groups")
    large = _inputs(rank, 5_000_000, torch.float32)  # 20 MB: two 16 MiB chunks
    ours, ref = large.clone(), large.clone()
    dist.all_reduce(ours, group=big)
    dist.all_reduce(ref, group=gloo)
    _close(ours, ref, n == 2, "large all_reduce, default slots")
    gloo_pair = dist.new_group([0, 1])  # every rank takes part in new_group
    if rank in (0, 1):
        _reductions(rank, 2, gloo_pair, pair)

    # functional collectives (called from C++, find the group by name)
    x = _inputs(rank, 10, torch.float32)
    xs = [_inputs(r, 10, torch.float32) for r in range(n)]
    _close(funcol.all_reduce(x, "sum", world).wait(), sum(xs[1:], xs[0]), n == 2, "funcol")
    _same(funcol.all_gather_tensor(x, 0, world).wait(), torch.cat(xs), "funcol all_gather")
    # object collectives (all_gather and broadcast underneath)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "pad": "x" * rank * 100})
    assert [o["rank"] for o in objs] == list(range(n))
    box = [{"from": rank}]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [{"from": n - 1}]
    _failures(rank, n)
    dist.destroy_process_group()
    assert world._closed  # destroy_process_group shut the group down


def _failures(rank, n):
    """Mismatched calls fail clearly; the group is then unusable (each case on its own group)."""
    g = dist.new_group(backend=NAME)
    with pytest.raises(shm.ShmBackendError, match=r"collective mismatch: this rank called "
                       r"all_reduce\(float32, \d+ bytes, SUM\) but rank \d called all_reduce"):
        dist.all_reduce(torch.zeros(4 if rank == 0 else 8), group=g)
    with pytest.raises(shm.ShmBackendError, match="unusable after an earlier error"):
        dist.barrier(group=g)

    g = dist.new_group(backend=NAME)  # rank 0 sends 2 bytes to rank 1, which expects 1
    ins = torch.ones(n + (rank == 0), dtype=torch.uint8)
    out = torch.empty(n, dtype=torch.uint8)
    splits = [1, 2] + [1] * (n - 2) if rank == 0 else [1] * n
    if rank == 1:
        with pytest.raises(shm.ShmBackendError, match="mismatched splits: rank 0 sends 2 bytes "
                           "to rank 1, which expects 1 bytes"):
            dist.all_to_all_single(out, ins, [1] * n, splits, group=g)
    else:
        try:  # the others' view is consistent: they may finish, or see rank 1's abort
            dist.all_to_all_single(out, ins, [1] * n, splits, group=g)
        except shm.ShmBackendError as err:
            assert "broke the group" in str(err), err

    g = dist.new_group([0, 1], backend=NAME)  # rank 0 is interrupted in the middle of a call
    if rank == 0:
        def interrupted(*args):
            raise KeyboardInterrupt
        g._sync.wait = interrupted
        with pytest.raises(KeyboardInterrupt):
            dist.all_reduce(torch.zeros(2), group=g)
        del g._sync.wait
        with pytest.raises(shm.ShmBackendError, match="unusable after an earlier error "
                           r"\(.*all_reduce on rank 0 .* was interrupted by KeyboardInterrupt"):
            dist.all_reduce(torch.zeros(2), group=g)
    elif rank == 1:
        with pytest.raises(shm.ShmBackendError, match="failed because rank 0 broke the group: "
                           ".* was interrupted by KeyboardInterrupt in the middle of the call"):
            dist.all_reduce(torch.zeros(2), group=g)

    g = dist.new_group([0, 1], backend=NAME)  # rank 0 broadcasts, rank 1 all_reduces
    if rank == 0:
        dist.broadcast(torch.zeros(2), src=0, group=g)  # the root does not wait: returns
        with pytest.raises(shm.ShmBackendError, match=r"barrier on rank 0 of group .* failed "
                           "because rank 1 broke the group: .*collective mismatch"):
            dist.barrier(group=g)
    elif rank == 1:
        with pytest.raises(shm.ShmBackendError, match=r"called all_reduce\(float32, 8 bytes, "
                           r"SUM\) but rank 0 called broadcast\(float32, 8 bytes, root 0\)"):
            dist.all_reduce(torch.zeros(2), group=g)


def _training(rank, n, store):
    """DDP, FSDP (1 and 2) and ZeroRedundancyOptimizer train to the same losses as on gloo."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = _init(rank, n, store)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def train(wrapped, opt, steps=4):
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(wrapped(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    def ddp(group):
        m = DDP(model(), process_group=group)
        return train(m, torch.optim.SGD(m.parameters(), lr=0.1))

    def fsdp2(group):
        m = model()
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (m[0], m[2], m[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return train(m, torch.optim.Adam(m.parameters(), lr=0.01))

    def fsdp1(group):  # FSDP1 on CPU needs an explicit device_id
        m = FSDP(model(), process_group=group, device_id=torch.device("cpu"))
        return train(m, torch.optim.Adam(m.parameters(), lr=0.01))

    def zero(group):
        m = DDP(model(), process_group=group)
        opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam,
                                      process_group=group, lr=0.01)
        return train(m, opt)

    out = {}
    for name, fn in (("ddp", ddp), ("fsdp1", fsdp1), ("fsdp2", fsdp2), ("zero", zero)):
        ours, ref = fn(dist.group.WORLD), fn(gloo)
        assert ours == pytest.approx(ref, rel=1e-5, abs=1e-6), (name, ours, ref)
        out[name] = [ours, ref]
    dist.destroy_process_group()
    return out


def _rank_dies(rank, n, store):
    """Rank 2 dies in the middle of a chunked all_reduce; the others get a clear error."""
    _init(rank, n, store, timeout=60)
    world = dist.group.WORLD
    # the file is gone as soon as every rank has mapped it: a crash cannot leave it behind
    assert not os.path.exists(world._seg.path)
    x = torch.ones(200_000)
    dist.all_reduce(x)
    if rank == 2:  # die after the first phase of the next call, data half-written
        arrive, last = world._sync.arrive, world._sync.phase + 1
        world._sync.arrive = lambda p: arrive(p) if p <= last else os._exit(7)
    with pytest.raises(shm.ShmBackendError) as info:
        dist.all_reduce(x)
    with pytest.raises(shm.ShmBackendError, match="unusable after an earlier error"):
        dist.all_reduce(x)
    dist.destroy_process_group()
    return str(info.value)


def _rank_absent(rank, n, store):
    """Rank 1 is alive but never joins in time: rank 0 times out, rank 1 then sees why."""
    gloo = _init(rank, n, store, timeout=2)
    if rank == 0:
        with pytest.raises(shm.ShmBackendError, match=r"all_reduce on rank 0 of group .* timed "
                           r"out after 2s waiting for rank\(s\) \[1\]"):
            dist.all_reduce(torch.zeros(4))
        dist.barrier(group=gloo)
    else:
        dist.barrier(group=gloo)  # returns once rank 0 has timed out (gloo waits 2 s too)
        with pytest.raises(shm.ShmBackendError, match="failed because rank 0 broke the group: "
                           ".*timed out"):
            dist.all_reduce(torch.zeros(4))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------- tests
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_gloo(world_size):
    _run(_collectives, world_size, timeout=60)


@pytest.mark.timeout(120)
def test_ddp_fsdp_zero_train_like_gloo():
    results = _run(_training, 2)
    assert set(results[0]) == {"ddp", "fsdp1", "fsdp2", "zero"}


@pytest.mark.timeout(120)
def test_rank_death_is_an_error_not_a_hang():
    results = _run(_rank_dies, 3, may_die=(2,))
    messages = [results[r] for r in (0, 1)]
    # at least one survivor saw the death itself; the other may quote it from the first.
    # "died", not "timed out": the liveness check found it, not the 60 s deadline.
    assert any("failed: rank 2 (pid" in m and "died" in m for m in messages), messages
    for m in messages:
        assert "died" in m and "timed out" not in m, m


@pytest.mark.timeout(120)
def test_absent_rank_times_out():
    _run(_rank_absent, 2)


@pytest.mark.timeout(120)
def test_nbdist_group_with_registered_backend():
    """Selectable by name in nbdist.start once registered with nbdist.register_backend."""
    known = "nbdist_shm" in nbdist.backends.registered_backends()  # (nbdist may do it already)
    nbdist.register_backend("nbdist_shm", "nbdist.shm:create", devices=["cpu"])
    try:
        g = nbdist.start(2, backend="nbdist_shm", device="cpu", timeout=30)
        try:
            out = g.exec("import torch, torch.distributed as dist\n"
                         "t = torch.full((1000,), float(dist.get_rank() + 1))\n"
                         "dist.all_reduce(t)\n"
                         "(dist.get_backend(), t[0].item())")
        finally:
            g.stop()
    finally:
        if not known:
            nbdist.backends.unregister_backend("nbdist_shm")
    assert out == [("nbdist_shm", 3.0)] * 2


# ------------------------------------------------------- single-process tests (no spawn)
T = timedelta(seconds=5)


@pytest.fixture
def solo():
    """A one-rank group on a HashStore, shut down after the test."""
    pg = shm.create(dist.HashStore(), 0, 1, T, slot_bytes=64 << 10)
    yield pg
    pg.shutdown()


def _opts(kind, **fields):
    opts = getattr(dist, kind)()
    for k, v in fields.items():
        setattr(opts, k, v)
    return opts


@pytest.mark.timeout(60)
def test_one_rank_group_runs_every_op(solo):
    x = torch.arange(100_000, dtype=torch.float32)
    for red in (R.SUM, R.AVG, R.MAX):
        t = x.clone()
        assert solo.allreduce([t], _opts("AllreduceOptions", reduceOp=red)).is_completed()
        _same(t, x)
    solo.broadcast([t], _opts("BroadcastOptions", rootRank=0))
    out = [[torch.empty(100_000)]]
    solo.allgather(out, [x])
    _same(out[0][0], x)
    out = torch.empty(100_000)
    solo.reduce_scatter_single(out, x, _opts("ReduceScatterOptions", reduceOp=R.SUM))
    _same(out, x)
    solo.all_to_all_single(out, x, [], [], _opts("AllToAllOptions"))
    _same(out, x)
    solo.barrier()
    assert solo.getBackendName() == "nbdist_shm" and solo.size() == 1


@pytest.mark.timeout(60)
def test_bad_arguments_are_explained(solo):
    a3, a2 = torch.ones(3), torch.ones(2)
    cases = [
        (lambda: solo.reduce_scatter_single(a3, torch.ones(5), _opts("ReduceScatterOptions")),
         r"input must have world size \(1\) times the elements of output"),
        (lambda: solo.reduce_scatter([a3], [[a3, a3]], _opts("ReduceScatterOptions")),
         "needs a list of 1 input tensors, got 2"),
        (lambda: solo.allgather([[a3]], [torch.ones(3, dtype=torch.int64)]),
         "output and input dtypes differ"),
        (lambda: solo.allgather([[a3]], [a2]),
         "this rank's output has 12 bytes but its input has 8"),
        (lambda: solo.allgather([[a3, a3]], [a3]), "needs a list of 1 output tensors, got 2"),
        (lambda: solo.all_gather_single(a3, a2),
         r"output must have world size \(1\) times the elements of input"),
        (lambda: solo.all_to_all_single(a3, a3, [], [2]),
         r"cannot split the 3 rows of input into 1 pieces of sizes \[2\]"),
        (lambda: solo.alltoall([a3], [a3, a3]), "needs 1 input and output tensors"),
    ]
    for call, text in cases:
        with pytest.raises(ValueError, match=text):
            call()
    solo.barrier()  # still usable: nothing was sent
    solo.shutdown()
    with pytest.raises(RuntimeError, match="all_reduce on rank 0 of group .* has been shut down"):
        solo.allreduce([a3], _opts("AllreduceOptions"))


def _host(store, rank, identity):
    store.set(f"nbdist_shm/host/{rank}", json.dumps(identity))


@pytest.mark.timeout(60)
def test_ranks_on_two_hosts_are_refused():
    store = dist.HashStore()
    _host(store, 1, {"host": "elsewhere", "boot_id": "0123456789"})
    text = r"must all run on one host .* rank 1: elsewhere \(boot 01234567\)"
    with pytest.raises(shm.ShmBackendError, match=text):
        shm.create(store, 0, 2, T)
    with pytest.raises(shm.ShmBackendError, match=text):  # rank 1 hears it from rank 0
        shm.create(store, 1, 2, T)


@pytest.mark.timeout(60)
def test_setup_timeouts_name_the_missing_ranks():
    quick = timedelta(seconds=0.3)
    with pytest.raises(shm.ShmBackendError, match=r"set-up timed out after 0.3s waiting for the "
                       r"host identity from rank\(s\) \[1, 2\]"):
        shm.create(dist.HashStore(), 0, 3, quick)
    with pytest.raises(shm.ShmBackendError, match=r"waiting for the segment name from rank\(s\) "
                       r"\[0\]"):
        shm.create(dist.HashStore(), 1, 2, quick)
    store = dist.HashStore()  # rank 1 says hello, then never maps the segment
    _host(store, 1, segment.host_identity())
    with pytest.raises(shm.ShmBackendError, match=r"waiting for the attachment from rank\(s\) "
                       r"\[1\]"):
        shm.create(store, 0, 2, quick)
    # (the autouse fixture checks that rank 0 removed the segment it had created)


@pytest.mark.timeout(60)
def test_segment_problems_are_explained(monkeypatch):
    store = dist.HashStore()
    store.set("nbdist_shm/id", json.dumps({"name": "nbdist-shm-missing", "slot_bytes": 8192,
                                           "nonce": 1}))
    with pytest.raises(shm.ShmBackendError, match="cannot open the group's segment "
                       ".*nbdist-shm-missing: the ranks do not share"):
        shm.create(store, 1, 2, T)
    path = os.path.join(segment.SHM_DIR, f"nbdist-shm-test{os.getpid()}")
    with open(path, "wb") as f:  # a file with the right name but not rank 0's header
        f.truncate(1 << 20)
    store.set("nbdist_shm/id", json.dumps({"name": os.path.basename(path), "slot_bytes": 8192,
                                           "nonce": 1}))
    with pytest.raises(shm.ShmBackendError, match="its header is not the one rank 0 wrote"):
        shm.create(store, 1, 2, T)
    assert not os.path.exists(path)
    with pytest.raises(shm.ShmBackendError, match=r"has \d+ MiB free but a group of 1 ranks "
                       "needs .* smaller slot_bytes"):
        shm.create(dist.HashStore(), 0, 1, T, slot_bytes=1 << 50)
    monkeypatch.setattr(segment.platform, "machine", lambda: "aarch64")
    with pytest.raises(shm.ShmBackendError, match="refuses to run on 'aarch64'"):
        shm.create(dist.HashStore(), 0, 1, T)


@pytest.mark.timeout(60)
def test_register_is_idempotent_and_refuses_taken_names():
    assert shm.register("nbdist_shm_reg") == "nbdist_shm_reg"
    assert shm.register("nbdist_shm_reg") == "nbdist_shm_reg"
    assert dist.Backend.backend_capability["nbdist_shm_reg"] == ["cpu"]
    with pytest.raises(ValueError, match="'gloo' is already taken by another backend"):
        shm.register("gloo")
