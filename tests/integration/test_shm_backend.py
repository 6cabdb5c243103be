"""Integration tests for the nbdist_shm backend (nbdist.shm), with real rank processes.

Multi-process tests host a TCPStore in the pytest process, start the ranks as fresh processes
(spawned.py: children of nbdist's forkserver, or spawned where there is none) and collect one
result string per rank through that store
("ok" or a traceback). Each rank checks every collective against gloo on the same inputs
(a gloo group of the same ranks): bitwise where the reduction order allows it, else with the
tolerance stated at ``_TOL``. Many checks share one spawned run to keep the file fast. Small
slots (``slot_bytes=64 KiB``) make modest tensors move in many chunks. Every test checks that
no ``/dev/shm/nbdist-shm-*`` segment is left behind; the suite's conftest checks for leaked
child processes.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import nbdist
from nbdist.backends import shm
# tests/integration, on sys.path; no_segments_left: an autouse fixture
from shm_harness import (FLOATS, INTS, NAME, R, _close, _identical_on_all_ranks, _init,  # noqa: F401
                         _inputs, _run, _same, no_segments_left)


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
    big = dist.new_group(backend=shm.register("nbdist_shm_12m", slot_bytes=12 << 20))  # large
    mine = [g for g in (world, pair, tail, big) if g is not dist.GroupMember.NON_GROUP_MEMBER]
    paths = [g._seg.path for g in mine]
    assert len(set(paths)) == len(paths)
    for i in range(3):
        for g in mine:
            v = torch.full((1000,), float(rank + i))
            dist.all_reduce(v, group=g)
            ranks = dist.get_process_group_ranks(g)
            _same(v, torch.full((1000,), float(sum(r + i for r in ranks))), "many groups")
    large = _inputs(rank, 5_000_000, torch.float32)  # 20 MB: in 4 or 6 MiB chunks
    ours, ref = large.clone(), large.clone()
    dist.all_reduce(ours, group=big)
    dist.all_reduce(ref, group=gloo)
    _close(ours, ref, n == 2, "large all_reduce, large slots")
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




# ------------------------------------------------------------------------------- tests
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_collectives_match_gloo(world_size):
    _run(_collectives, world_size, timeout=60)



def _large_with_cores(rank, n, store, cores):
    """Large collectives (20 MB, several chunks) on slots of 12 MiB, where the OS tells rank r
    that it may run on ``cores[r]`` cores: the host's answer, faked in this rank (it sets
    how the backend chunks, spins and caps threads). Ranks pinned differently (taskset, numactl,
    srun --cpu-bind) must still cut every tensor the same way."""
    import os

    os.sched_getaffinity = lambda pid: set(range(cores[rank]))
    gloo = _init(rank, n, store, name="nbdist_shm_large", slot_bytes=12 << 20)
    big = 5_000_000  # 20 MB of float32: past the 4 MiB cache chunks and the 6 MiB half slots
    x = _inputs(rank, big, torch.float32)
    ours, ref = x.clone(), x.clone()
    dist.all_reduce(ours)
    dist.all_reduce(ref, group=gloo)
    _close(ours, ref, n == 2, "large all_reduce")
    _identical_on_all_ranks(ours, gloo)
    y = x.clone()
    dist.broadcast(y, src=n - 1)
    _same(y, _inputs(n - 1, big, torch.float32), "large broadcast")
    ours, ref = torch.empty(n * big), torch.empty(n * big)
    dist.all_gather_into_tensor(ours, x)
    dist.all_gather_into_tensor(ref, x, group=gloo)
    _same(ours, ref, "large all_gather_into_tensor")
    inp = _inputs(rank, n * (big // n), torch.float32)
    ours, ref = torch.empty(big // n), torch.empty(big // n)
    dist.reduce_scatter_tensor(ours, inp)
    dist.reduce_scatter_tensor(ref, inp, group=gloo)
    _close(ours, ref, n == 2, "large reduce_scatter_tensor")
    ours, ref = torch.empty_like(inp), torch.empty_like(inp)
    dist.all_to_all_single(ours, inp)
    dist.all_to_all_single(ref, inp, group=gloo)
    _same(ours, ref, "large all_to_all_single")
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cores", [(64, 64), (1, 1), (1, 64), (64, 1, 64)],
                         ids=["a-core-each", "fewer-cores-than-ranks", "pinned-differently",
                              "pinned-differently-3-ranks"])
def test_large_collectives_whatever_cores_each_rank_sees(cores):
    _run(functools.partial(_large_with_cores, cores=cores), len(cores), timeout=90)


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
