"""nccl groups on CUDA: the auto-pick, all_reduce against gloo, the collective bench, a rank that
dies inside a collective and an interrupt there, and two ranks on one GPU."""
import os
import signal
import threading
import time

import pytest
import torch

import nbdist
from nbdist import bench

from gpu_checks import report

#: nccl-tests' bus bandwidth factors (doc/PERFORMANCE.md there), written out here so that the
#: check does not compare nbdist's table with itself
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}


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


def _sum_of_ranks(n, device=None):
    import torch.distributed as dist

    device = device or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    t = torch.arange(n, dtype=torch.float32, device=device) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.cpu()


def test_all_reduce_matches_gloo(nccl_group, gpu_pair, world):
    """nccl (and the two CUDA ranks) against gloo on CPU, element for element."""
    on_gpu = {"nccl": nccl_group.run(_sum_of_ranks, 1 << 20)}
    with nbdist.start(world, backend="gloo", device="cpu") as g:
        on_cpu = {world: g.run(_sum_of_ranks, 1 << 20)}
    if world != 2:
        on_gpu["pair"] = gpu_pair.run(_sum_of_ranks, 1 << 20, "cuda")
        with nbdist.start(2, backend="gloo", device="cpu") as g:
            on_cpu[2] = g.run(_sum_of_ranks, 1 << 20)
    for name, outs in on_gpu.items():
        for a, b in zip(outs, on_cpu[len(outs)]):
            torch.testing.assert_close(a, b)
    report("all_reduce parity", elements=1 << 20, world=world, pair=gpu_pair.backend, equal=True)


def test_bench_busbw_as_nccl_tests_define_it(nccl_group, world):
    recs = bench.collectives(nccl_group, ops=["all_reduce", "all_gather"], sizes="1M-256M",
                             iters=20, warmup=5, progress=False)
    assert all(r["status"] == "ok" for r in recs), [(r["op"], r["bytes"], r["note"]) for r in recs]
    for r in recs:
        assert r["backend"] == "nccl" and r["device"] == "cuda" and r["verified"] is True
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-6)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * BUS_FACTOR[r["op"]](world))
    top = max(recs, key=lambda r: (r["op"] == "all_reduce", r["bytes"]))
    report("bench", world=world, op=top["op"], bytes=top["bytes"],
           algbw_GBps=f"{top['algbw_GBps']:.1f}", busbw_GBps=f"{top['busbw_GBps']:.1f}",
           median_us=f"{top['time_s'] * 1e6:.0f}")
    if world < 2:
        report("bench busbw", note="'not covered: one rank, so the bus factor is 0'")
    print(recs)


def _warm_collective():
    """A first collective on both ranks: nccl sets its communicator up lazily, at the first
    collective; the failure tests must fail inside a collective, not inside that setup."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device="cuda"))
    torch.cuda.synchronize()


def _die_in_all_reduce():
    import torch.distributed as dist

    t = torch.ones(1 << 20, device="cuda")
    if dist.get_rank() == 1:
        time.sleep(1.0)  # rank 0 is inside the all_reduce by then
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)  # rank 0 waits for a peer that is gone
    torch.cuda.synchronize()


def _not_on_one_gpu(ngpu, what):
    if ngpu < 2:
        report(what, note="'not covered on nccl: one GPU here, and NCCL refuses two ranks on one "
                          "device; run on gloo with CUDA tensors instead'")


def test_a_rank_dies_inside_a_collective(gpu_pair, ngpu):
    _not_on_one_gpu(ngpu, "rank dies in nccl all_reduce")
    gpu_pair.run(_warm_collective)
    t0 = time.monotonic()
    with pytest.raises(nbdist.RankDiedError) as err:
        gpu_pair.call(_die_in_all_reduce, timeout=60)
    took = time.monotonic() - t0
    assert "rank 1" in str(err.value)
    report(f"rank dies in {gpu_pair.backend} all_reduce on CUDA", seconds=f"{took:.1f}",
           message=repr(str(err.value).splitlines()[0]))
    gpu_pair.restart()
    assert gpu_pair.run(lambda: torch.distributed.get_rank()) == [0, 1]


def _hang_in_all_reduce():
    import torch.distributed as dist

    t = torch.ones(1 << 10, device="cuda")
    if dist.get_rank() == 0:
        dist.all_reduce(t)  # rank 1 never joins
        torch.cuda.synchronize()
    else:
        time.sleep(600)


def test_an_interrupt_inside_a_collective(gpu_pair, ngpu):
    _not_on_one_gpu(ngpu, "interrupt in nccl all_reduce")
    gpu_pair.run(_warm_collective)
    timer = threading.Timer(3.0, lambda: signal.pthread_kill(threading.main_thread().ident,
                                                             signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises((nbdist.GroupInterrupted, KeyboardInterrupt)) as err:
            gpu_pair.call(_hang_in_all_reduce, timeout=120)
    finally:  # a call that failed early must not get the SIGINT later, in another test
        timer.cancel()
    report(f"interrupt in {gpu_pair.backend} all_reduce on CUDA",
           seconds=f"{time.monotonic() - t0:.1f}",
           message=repr(str(err.value).splitlines()[0] if str(err.value) else ""))
    gpu_pair.restart()
    assert gpu_pair.run(lambda: torch.distributed.get_rank()) == [0, 1]


def test_two_ranks_share_one_gpu(ngpu):
    """Two ranks, one GPU: gloo on CUDA tensors works (``gpu_pair``); nccl refuses (NCCL forbids
    two ranks of one communicator on one device): the error must be clear and quick, never a
    hang."""
    if ngpu != 1:
        pytest.skip(f"a one-GPU case ({ngpu} GPUs here)")
    with pytest.raises(ValueError, match="one rank per GPU"):
        nbdist.start(2, backend="nccl", device="cuda")
    t0 = time.monotonic()
    with nbdist.start(2, backend="nccl", device="cuda", max_world_size=2, timeout=60) as g:
        assert g.run(torch.cuda.current_device) == [0, 0]  # rank 1 shares GPU 0
        try:
            out = g.call(_sum_of_ranks, (16,), timeout=60)
            verdict = f"ran: {out[0][:3].tolist()}"
        except nbdist.NbdistError as err:
            verdict = f"refused: {str(err).splitlines()[0]}"
    took = time.monotonic() - t0
    report("two nccl ranks on one GPU", seconds=f"{took:.1f}", verdict=repr(verdict))
    assert took < 120
