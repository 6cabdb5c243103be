"""The nbdist_shm backend under training and failure, with real rank processes: DDP, FSDP 1 and 2
and ZeroRedundancyOptimizer train as on gloo; a dying rank is an error naming it, not a hang; an
absent rank times out. Harness: shm_harness.py."""

import os

import pytest
import torch
import torch.distributed as dist

from nbdist.backends import shm
# tests/integration, on sys.path; no_segments_left: an autouse fixture
from shm_harness import _init, _run, no_segments_left  # noqa: F401


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

