"""Single-process tests of the nbdist_shm backend (nbdist.shm): one rank, or ranks faked as
hosts, in this process (no spawn): the API's refusals and setup errors. The multi-process
suites: test_shm_backend.py."""

import json
import os
import shutil
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from nbdist.backends import shm  # noqa: E402
from nbdist.backends.shm import segment  # noqa: E402
# tests/integration, on sys.path; no_segments_left: an autouse fixture
from shm_harness import R, _same, no_segments_left  # noqa: E402,F401

T = timedelta(seconds=5)
Usage = type(shutil.disk_usage("."))  # (total, used, free)


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


def test_default_slots_fit_a_small_dev_shm():
    mib, kib = 1 << 20, 1 << 10  # Docker's default /dev/shm is 64 MiB: a group takes <= half
    assert segment.default_slot_bytes(2, 1 << 30) == 32 * mib
    assert segment.default_slot_bytes(2, 64 * mib) == 16 * mib - 8 * kib
    assert segment.default_slot_bytes(4, 64 * mib) == 8 * mib - 8 * kib
    assert segment.default_slot_bytes(2, 1 * mib) == 1 * mib  # the floor: refused below


@pytest.mark.timeout(60)
@pytest.mark.parametrize("free_mib", [64, 4096])
def test_a_default_group_takes_what_dev_shm_has_room_for(monkeypatch, free_mib):
    free = free_mib << 20  # the host's answer, faked: /dev/shm's size differs between machines
    monkeypatch.setattr(segment.shutil, "disk_usage", lambda path: Usage(free, 0, free))
    pg = shm.create(dist.HashStore(), 0, 1, T)  # no slot_bytes: the default
    try:
        assert pg._seg.slot_bytes == segment.default_slot_bytes(1, free)
        assert pg._seg.nbytes <= free // 2
        t = torch.ones(3 << 20)  # 12 MiB: in several chunks
        pg.allreduce([t]).wait()
        _same(t, torch.ones(3 << 20))
    finally:
        pg.shutdown()
    monkeypatch.setattr(segment.shutil, "disk_usage", lambda path: Usage(free, 0, 1 << 20))
    with pytest.raises(shm.ShmBackendError, match=r"has 1 MiB free but a group of 1 ranks needs "
                       r"1 MiB .*Free space there \(in a container: a larger --shm-size\)"):
        shm.create(dist.HashStore(), 0, 1, T)


@pytest.mark.timeout(60)
def test_register_is_idempotent_and_refuses_taken_names():
    assert shm.register("nbdist_shm_reg") == "nbdist_shm_reg"
    assert shm.register("nbdist_shm_reg") == "nbdist_shm_reg"
    assert dist.Backend.backend_capability["nbdist_shm_reg"] == ["cpu"]
    with pytest.raises(ValueError, match="'gloo' is already taken by another backend"):
        shm.register("gloo")
