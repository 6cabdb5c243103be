"""nccl groups on CUDA: the auto-pick, all_reduce against gloo, the collective bench, a rank that
dies inside a collective and an interrupt there, and two ranks on one GPU."""
import os
import signal
import time

import pytest
import torch

import nbdist
from nbdist import bench

from gpu_checks import report


def test_auto_picks_nccl_on_cuda(nccl_group, world):
    assert nccl_group.backend == "nccl"
    names = nccl_group.run(lambda: (torch.distributed.get_backend(),
                                    torch.cuda.current_device()))
    assert [b for b, _ in names] == ["nccl"] * world
    assert [d for _, d in names] == list(range(world))  # one GPU per rank, by local rank
    choice = nbdist.resolve_backend("auto", device="cuda")
    report("auto-pick", backend=choice.backend, note=repr(choice.note), world=world,
           gpus=torch.cuda.device_count(), name=repr(torch.cuda.get_device_name(0)),
           nccl=".".join(map(str, torch.cuda.nccl.version())))


def _sum_of_ranks(n):
    import torch.distributed as dist

    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.arange(n, dtype=torch.float32, device=device) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.cpu()


def test_all_reduce_matches_gloo(nccl_group, world):
    on_nccl = nccl_group.run(_sum_of_ranks, 1 << 20)
    with nbdist.start(world, backend="gloo", device="cpu") as g:
        on_gloo = g.run(_sum_of_ranks, 1 << 20)
    for a, b in zip(on_nccl, on_gloo):
        torch.testing.assert_close(a, b)
    report("all_reduce parity", elements=1 << 20, world=world, equal=True)


def test_bench_busbw_as_nccl_tests_define_it(nccl_group, world):
    recs = bench.collectives(nccl_group, ops=["all_reduce", "all_gather"], sizes="1M-256M",
                             iters=20, warmup=5, progress=False)
    assert all(r["status"] == "ok" for r in recs), [(r["op"], r["bytes"], r["note"]) for r in recs]
    for r in recs:
        assert r["backend"] == "nccl" and r["device"] == "cuda" and r["verified"] is True
        if world > 1:
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]
                                                    * bench.bus_factor(r["op"], world))
    top = max(recs, key=lambda r: (r["op"] == "all_reduce", r["bytes"]))
    report("bench", world=world, op=top["op"], bytes=top["bytes"],
           algbw_GBps=f"{top['algbw_GBps']:.1f}", busbw_GBps=f"{top['busbw_GBps']:.1f}",
           median_us=f"{top['time_s'] * 1e6:.0f}")
    print(recs)


def _die_in_all_reduce():
    import torch.distributed as dist

    t = torch.ones(1 << 20, device="cuda")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)  # rank 0 waits for a peer that is gone
    torch.cuda.synchronize()


def test_a_rank_dies_inside_an_nccl_collective(two_gpus):
    with nbdist.start(2, backend="nccl", device="cuda", timeout=60) as g:
        t0 = time.monotonic()
        with pytest.raises(nbdist.RankDiedError) as err:
            g.call(_die_in_all_reduce, timeout=60)
        took = time.monotonic() - t0
        assert "rank 1" in str(err.value)
        report("rank dies in nccl all_reduce", seconds=f"{took:.1f}",
               message=repr(str(err.value).splitlines()[0]))
        g.restart()
        assert g.run(lambda: torch.distributed.get_rank()) == [0, 1]


def _hang_in_all_reduce():
    import torch.distributed as dist

    t = torch.ones(1 << 10, device="cuda")
    if dist.get_rank() == 0:
        dist.all_reduce(t)  # rank 1 never joins
        torch.cuda.synchronize()
    else:
        time.sleep(600)


def test_an_interrupt_inside_an_nccl_collective(two_gpus):
    import threading

    with nbdist.start(2, backend="nccl", device="cuda", timeout=60) as g:
        threading.Timer(3.0, lambda: signal.pthread_kill(threading.main_thread().ident,
                                                         signal.SIGINT)).start()
        t0 = time.monotonic()
        with pytest.raises((nbdist.GroupInterrupted, KeyboardInterrupt)) as err:
            g.call(_hang_in_all_reduce, timeout=120)
        report("interrupt in nccl all_reduce", seconds=f"{time.monotonic() - t0:.1f}",
               message=repr(str(err.value).splitlines()[0] if str(err.value) else ""))
        g.restart()
        assert g.run(lambda: torch.distributed.get_rank()) == [0, 1]


def test_two_ranks_share_one_gpu(ngpu):
    """Two ranks, one GPU: gloo on CUDA tensors works; nccl refuses (NCCL forbids two ranks of one
    communicator on one device): the error must be clear and quick, never a hang."""
    if ngpu != 1:
        pytest.skip(f"a one-GPU case ({ngpu} GPUs here)")
    with pytest.raises(ValueError, match="one rank per GPU"):
        nbdist.start(2, backend="nccl", device="cuda")
    t0 = time.monotonic()
    try:
        with nbdist.start(2, backend="nccl", device="cuda", max_world_size=2, timeout=60) as g:
            out = g.call(_sum_of_ranks, (16,), timeout=60)
            verdict = f"ran: {out[0][:3].tolist()}"
    except nbdist.NbdistError as err:
        verdict = f"refused: {str(err).splitlines()[0]}"
    took = time.monotonic() - t0
    report("two nccl ranks on one GPU", seconds=f"{took:.1f}", verdict=repr(verdict))
    assert took < 120
