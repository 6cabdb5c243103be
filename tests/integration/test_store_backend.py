"""Integration tests for nbdist.store_backend, with real rank processes.

Each multi-process test starts its ranks with spawned.py's ``run_ranks`` (a TCPStore in the
pytest process; each rank reports its result or its traceback through it). Many checks share
one run of the ranks to keep the file fast.
"""

import os
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nbdist.backends import store as store_backend  # noqa: E402

from spawned import run_ranks as _run  # noqa: E402 -- tests/integration, on sys.path


def _init(rank, world_size, store, timeout=30):
    store_backend.register()
    store_backend.register()  # idempotent
    dist.init_process_group("nbstore", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))


def _data(r, n=6, dtype=torch.float32):
    """Rank r's input: distinct, exactly representable values."""
    return (torch.arange(n, dtype=torch.float64) * (r + 1) + r - 2).to(dtype)


def _quiet_key_count(store, rank, n):
    """Rank 0 counts the store's keys while no nbstore call is in flight on any rank.

    Ranks 1.. check in by a send (so their earlier calls, clean-up included, are over) and
    then wait in a recv until rank 0 has counted. Other ranks return None.
    """
    dist.barrier()
    token = torch.zeros(1)
    if rank != 0:
        dist.send(token, dst=0)
        dist.recv(token, src=0)
        return None
    for s in range(1, n):
        dist.recv(token, src=s)
    count = store.num_keys()
    for s in range(1, n):
        dist.send(token, dst=s)
    return count


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (a, b)


# ------------------------------------------------------------------------------ suites
def _collectives(rank, n, store):
    """Every supported op on the nbstore default group, checked locally and against gloo."""
    _init(rank, n, store)
    pg = dist.group.WORLD
    assert isinstance(pg, store_backend.StoreProcessGroup)
    assert (pg.rank(), pg.size(), pg.name()) == (rank, n, "nbstore")
    assert dist.get_backend() == "nbstore" and pg.group_name
    gloo = dist.new_group(backend="gloo")
    keys_before = _quiet_key_count(store, rank, n)
    R = dist.ReduceOp

    # all_reduce: every reduce op, float and int, compared to local expectations and gloo
    all_inputs = [_data(r) for r in range(n)]
    expected = {R.SUM: sum(all_inputs), R.AVG: sum(all_inputs) / n,
                R.PRODUCT: torch.stack(all_inputs).prod(0),
                R.MIN: torch.stack(all_inputs).min(0).values,
                R.MAX: torch.stack(all_inputs).max(0).values}
    for op, want in expected.items():
        t, g = _data(rank), _data(rank)
        dist.all_reduce(t, op=op)
        dist.all_reduce(g, op=op, group=gloo)
        assert torch.allclose(t, want) and torch.allclose(t, g), (op, t, want, g)
    for op in (R.SUM, R.MAX, R.BXOR):
        t, g = _data(rank, dtype=torch.int64), _data(rank, dtype=torch.int64)
        dist.all_reduce(t, op=op)
        dist.all_reduce(g, op=op, group=gloo)
        _same(t, g)
    # > 8 MiB: chunked through the TCPStore (the server rejects bigger values)
    big = torch.full((3_000_000,), float(rank + 1))
    dist.all_reduce(big)
    assert torch.all(big == n * (n + 1) / 2)
    pair = [_data(rank), _data(rank, 3)]
    dist.all_reduce_coalesced(pair, op=R.MAX)
    _same(pair[1], torch.stack([_data(r, 3) for r in range(n)]).max(0).values)
    work = dist.all_reduce(t := _data(rank), async_op=True)
    work.wait()
    assert work.is_completed() and torch.equal(t, expected[R.SUM])
    assert torch.equal(work.get_future().value()[0], expected[R.SUM])

    # broadcast (large too), from the last rank
    t = _data(rank)
    dist.broadcast(t, src=n - 1)
    _same(t, _data(n - 1))
    big = torch.arange(2_500_000, dtype=torch.float32) if rank == 0 else torch.zeros(2_500_000)
    dist.broadcast(big, src=0)
    _same(big, torch.arange(2_500_000, dtype=torch.float32))

    # all_gather (list, also with different shapes per rank) and all_gather_into_tensor
    outs = [torch.zeros(6) for _ in range(n)]
    dist.all_gather(outs, _data(rank))
    for r in range(n):
        _same(outs[r], _data(r))
    outs = [torch.zeros(r + 1, dtype=torch.int32) for r in range(n)]
    dist.all_gather(outs, torch.full((rank + 1,), rank, dtype=torch.int32))
    for r in range(n):
        _same(outs[r], torch.full((r + 1,), r, dtype=torch.int32))
    outs = [[torch.zeros(6), torch.zeros(2)] for _ in range(n)]
    dist.all_gather_coalesced(outs, [_data(rank), torch.tensor([rank, -rank * 1.0])])
    for r in range(n):
        _same(outs[r][0], _data(r))
        _same(outs[r][1], torch.tensor([r, -r * 1.0]))
    out, g = torch.zeros(n * 6), torch.zeros(n * 6)
    dist.all_gather_into_tensor(out, _data(rank))
    dist.all_gather_into_tensor(g, _data(rank), group=gloo)
    _same(out, torch.cat(all_inputs))
    _same(out, g)
    out = torch.zeros(n, 6)  # a 2-d output works too on this backend
    dist.all_gather_into_tensor(out, _data(rank))
    _same(out, torch.stack(all_inputs))

    # reduce_scatter_tensor and reduce_scatter (list)
    inp = torch.cat([_data(rank) + 10 * d for d in range(n)])
    for op in (R.SUM, R.AVG, R.MAX):
        out, g = torch.zeros(6), torch.zeros(6)
        dist.reduce_scatter_tensor(out, inp, op=op)
        dist.reduce_scatter_tensor(g, inp, op=op, group=gloo)
        assert torch.allclose(out, g), (op, out, g)
    _same(out, torch.stack([_data(r) + 10 * rank for r in range(n)]).max(0).values)
    out = torch.zeros(6)
    dist.reduce_scatter(out, [_data(rank) * (d + 1) for d in range(n)])
    assert torch.allclose(out, sum(all_inputs) * (rank + 1))

    # all_to_all_single (even and uneven splits) and all_to_all (list)
    inp = torch.arange(n * 2) + 100 * rank
    out, g = torch.zeros(n * 2, dtype=torch.int64), torch.zeros(n * 2, dtype=torch.int64)
    dist.all_to_all_single(out, inp)
    dist.all_to_all_single(g, inp, group=gloo)
    _same(out, torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 100 * s for s in range(n)]))
    _same(out, g)
    in_splits = [s + 1 for s in range(n)]         # rank sends d+1 rows to rank d
    inp = torch.arange(sum(in_splits)) + 100 * rank
    out = torch.zeros((rank + 1) * n, dtype=torch.int64)
    dist.all_to_all_single(out, inp, [rank + 1] * n, in_splits)
    start = rank * (rank + 1) // 2
    _same(out, torch.cat([torch.arange(start, start + rank + 1) + 100 * s for s in range(n)]))
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), 10.0 * rank + d) for d in range(n)])
    for s in range(n):
        _same(outs[s], torch.full((2,), 10.0 * s + rank))

    # reduce, gather, scatter, send/recv
    t = _data(rank)
    dist.reduce(t, dst=n - 1)
    if rank == n - 1:
        _same(t, expected[R.SUM])
    gathered = [torch.zeros(6) for _ in range(n)] if rank == 0 else None
    dist.gather(_data(rank), gathered, dst=0)
    if rank == 0:
        for r in range(n):
            _same(gathered[r], _data(r))
    out = torch.zeros(6)
    dist.scatter(out, [_data(r) * 3 for r in range(n)] if rank == 1 else None, src=1)
    _same(out, _data(rank) * 3)
    recv = torch.zeros(6)
    for tag in (0, 0, 7):  # two messages on one channel, then another tag
        dist.send(_data(rank) + tag, dst=(rank + 1) % n, tag=tag)
        dist.recv(recv, src=(rank - 1) % n, tag=tag)
        _same(recv, _data((rank - 1) % n) + tag)
    dist.barrier()

    # clear errors for what is not supported; the group stays usable afterwards
    for bad, kind, text in [
        (lambda: dist.all_reduce(_data(rank), op=dist._make_nccl_premul_sum(2.0)),
         NotImplementedError, "nbstore backend: allreduce does not support"),
        (lambda: dist.all_reduce(_data(rank, dtype=torch.int64), op=R.AVG),
         RuntimeError, "AVG needs floating-point"),
        (lambda: dist.recv(torch.zeros(1)), NotImplementedError, "any source"),
    ]:
        with pytest.raises(kind, match=text):
            bad()
    t = _data(rank)
    dist.all_reduce(t)
    _same(t, expected[R.SUM])

    # every key written by the calls above has been deleted again
    keys_after = _quiet_key_count(store, rank, n)
    assert rank != 0 or keys_after == keys_before, (keys_before, keys_after)
    dist.destroy_process_group()


def _training(rank, n, store):
    """DDP, new_group and functional collectives on nbstore, compared with gloo."""
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, n, store)
    gloo = dist.new_group(backend="gloo")

    # a subgroup of ranks 0 and 1 (every rank must call new_group)
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        assert isinstance(sub, store_backend.StoreProcessGroup)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=sub)
        _same(t, torch.tensor([3.0]))
        assert dist.get_world_size(sub) == 2

    # functional collectives (they look the group up by name, and call in from C++)
    world = dist.group.WORLD
    _same(funcol.all_reduce(_data(rank), "sum", world).wait(), sum(_data(r) for r in range(n)))
    _same(funcol.all_gather_tensor(_data(rank), 0, world).wait(),
          torch.cat([_data(r) for r in range(n)]))
    inp = torch.cat([_data(rank) * (d + 1) for d in range(n)])
    _same(funcol.reduce_scatter_tensor(inp, "sum", 0, world).wait(),
          sum(_data(r) for r in range(n)) * (rank + 1))

    # one DDP step per backend from the same start: same loss, grads and weights
    def step(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        ddp = DDP(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(100 + rank)  # each rank its own batch
        x, y = torch.randn(32, 8), torch.randn(32, 2)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return loss.detach(), grads, [p.detach().clone() for p in model.parameters()]

    mine, ref = step(dist.group.WORLD), step(gloo)
    _same(mine[0], ref[0])
    for a, b in zip(mine[1] + mine[2], ref[1] + ref[2]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()
    dist.destroy_process_group()


def _failures(rank, n, store):
    """Mismatched collectives and a missing peer give clear errors, not hangs."""
    _init(rank, n, store, timeout=2)
    with pytest.raises(RuntimeError, match="allreduce mismatch: group rank"):
        dist.all_reduce(torch.zeros(4 * (rank + 1)))
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"allreduce .*timed out after 2s .*rank\(s\) \[1\]"):
            dist.all_reduce(torch.zeros(4))
        assert time.monotonic() - start < 10
    else:
        time.sleep(3)  # never joins the second all_reduce


# ------------------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives(world_size):
    _run(_collectives, world_size)


@pytest.mark.timeout(120)
def test_ddp_new_group_functional():
    _run(_training, 3)


@pytest.mark.timeout(120)
def test_errors_are_clear():
    _run(_failures, 2)


@pytest.mark.timeout(60)
def test_single_process_chunking_and_cleanup():
    """World size 1 on a HashStore: messages over the chunk size round-trip, no keys remain."""
    store = dist.HashStore()
    pg = store_backend.create(store, 0, 1, timedelta(seconds=5))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    t = torch.arange(3 * store_backend.CHUNK_BYTES // 4 + 5, dtype=torch.float32)
    work = pg.allreduce([t], opts)
    assert work.is_completed()
    _same(t, torch.arange(t.numel(), dtype=torch.float32))
    data = os.urandom(2 * store_backend.CHUNK_BYTES + 1)
    assert pg._put("x", data) == 3
    got, counts = pg._fetch("test", {0: "x"}, {0: len(data)})
    assert got[0] == data and counts == {0: 3}
    pg._delete("x", 3)
    assert store.num_keys() == 0


@pytest.mark.timeout(60)
def test_register_is_idempotent():
    """Names unique to this test, so other tests in this process see no registered nbstore."""
    assert store_backend.register("nbstore_regtest") == "nbstore_regtest"
    assert store_backend.register("nbstore_regtest") == "nbstore_regtest"
    assert "nbstore_regtest" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["nbstore_regtest"] == ["cpu"]
    creator = dist.Backend._plugins["NBSTORE_REGTEST"].creator_fn
    assert creator(dist.HashStore(), 0, 1, timedelta(seconds=1)).name() == "nbstore_regtest"
    # registered elsewhere with this module's plain create (as nbdist.register_backend does)
    dist.Backend.register_backend("nbstore_plain", store_backend.create, devices=["cpu"])
    assert store_backend.register("nbstore_plain") == "nbstore_plain"
    with pytest.raises(ValueError, match="already taken"):
        store_backend.register("gloo")
