"""The Windows smoke set (issue 26): every feature starts a group at least once, on the Windows
builds of CPython and torch (run under Wine in CI: scripts/test-windows.sh). It runs on Linux too,
as part of the whole suite, where it takes the Windows paths it can: spawn, and output through
pipes (NBDIST_STREAMS=pipe).

One group serves the module (a start under Wine takes 20-35 s: every rank imports torch); the
tests leave it usable, and the one that kills a rank restarts it.
"""
import os
import signal
import subprocess
import sys
import threading
import time
import _thread

import cloudpickle
import pytest
import torch

import nbdist
from nbdist import bench, memory
from nbdist.runtime import spares
from wingroup import windows_group  # tests/windows, on sys.path

pytestmark = pytest.mark.timeout(240)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file
WINDOWS = sys.platform == "win32"


@pytest.fixture(scope="module")
def g():
    with windows_group() as group:
        yield group


def test_exec_all_reduce_output_push_pull_and_a_remote_error(g):
    assert g.exec("import os; t = torch.ones(1) * (rank + 1); dist.all_reduce(t); "
                  "print('hi from', rank); "
                  "os.write(2, b'c-level\\n'); t.item()") == [3.0, 3.0]
    seen = {r: sorted(lines) for r, lines in g.last_output.items()}  # stdout, stderr: 2 streams
    assert seen == {0: ["c-level", "hi from 0"], 1: ["c-level", "hi from 1"]}  # C-level too
    g.push(x=torch.arange(6).reshape(2, 3))
    assert [t.tolist() for t in g.pull("x")] == [[[0, 1, 2], [3, 4, 5]]] * 2
    big = g.run(lambda: torch.ones(1 << 20))  # 4 MiB each way: no /dev/shm on Windows
    assert [float(t.sum()) for t in big] == [float(1 << 20)] * 2
    with pytest.raises(nbdist.RemoteError, match="ValueError on ranks 0, 1: boom"):
        g.exec("raise ValueError('boom')")
    assert g.state == "ready"


def test_interrupt_and_timeout_stop_the_ranks_and_keep_the_group(g):
    # The kernel's interrupt: on Windows ipykernel calls _thread.interrupt_main(); elsewhere it
    # sends SIGINT, which also wakes a blocked wait (interrupt_main alone only sets Python's flag,
    # seen when the call ends: 60 s later here on Linux)
    main = threading.get_ident()
    timer = threading.Timer(2.0, _thread.interrupt_main if WINDOWS else
                            lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(nbdist.GroupInterrupted, match="stopped on SIGINT; the group is "
                                                          "still usable"):
            g.exec("import time; time.sleep(60)")
    finally:
        timer.cancel()
    with pytest.raises(nbdist.DistTimeoutError, match="stopped on SIGINT; the group is still "
                                                      "usable") as info:
        g.exec("import time\ndef nap():\n    time.sleep(60)\nnap()", timeout=2)
    # where the ranks were, taken by their watchdogs before the interrupt (issue 27)
    assert "Where they were when the time ran out:\nranks 0, 1: <dist-cell-" in str(info.value)
    assert str(info.value).endswith(" nap")
    assert g.exec("rank") == [0, 1]


def test_the_collective_benchmark(g):
    records = bench.collectives(g, ops="all_reduce,broadcast", sizes="4K,64K", iters=2, warmup=1,
                                progress=False)
    assert len(records) == 4 and all(r["verified"] for r in records), records


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def test_memory_measure_with_ddp_zero1_fsdp_and_fsdp2(g):
    report = memory.measure(g, _mlp, strategies=("ddp", "zero1", "fsdp", "fsdp2"), steps=1,
                            batch=4)
    assert {d["strategy"] for d in report.to_dicts()} == {"ddp", "zero1", "fsdp", "fsdp2"}


def _toy_module():
    import pytorch_lightning as pl

    class Toy(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(int(os.environ.get("RANK", "0")))  # ranks start different
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Toy()


def _toy_data():
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])),
                      batch_size=8)


def test_lightning_fit_with_ddp(g):
    pytest.importorskip("pytorch_lightning", reason="Lightning is an extra: pip install "
                        "nbdist[lightning] (the Windows stack installs it)")
    from nbdist import lightning as nl

    results = nl.fit(g, _toy_module, _toy_data, "ddp", weights="all", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False)
    assert [r.global_step for r in results] == [4, 4]  # 32 samples / 2 ranks / batch 8, 2 epochs
    first, second = (r.load_into(_toy_module()).state_dict() for r in results)
    assert all(torch.equal(first[k], second[k]) for k in first)  # DDP kept the ranks in step
    assert g.exec("dist.get_backend()") == ["gloo", "gloo"]


@pytest.mark.allow_leaks  # the restarted ranks are the module group's: stopped after the module
def test_a_rank_death_is_reported_and_restart_takes_the_warm_spares(g):
    with pytest.raises(nbdist.RankDiedError, match="rank 1 exited with code 3"):
        g.exec("import os, time\nif rank == 1: os._exit(3)\ntime.sleep(30)")
    assert g.state in ("broken", "stopped")
    # the start kept warm spares (torch imported): the restart's ranks are those processes
    assert spares.ready(timeout=180) >= 2
    kept = set(spares.pids())
    g.restart()
    assert g.exec("rank") == [0, 1]
    assert set(g.run(os.getpid)) <= kept
    g.exec("import torch.distributed as dist\nt = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)")
    assert [t.tolist() for t in g.exec("t")] == [[3.0, 3.0]] * 2


def test_doctor_says_what_works_and_refuses_nbdist_shm_off_linux():
    out = subprocess.run([sys.executable, "-m", "nbdist", "doctor"], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert "gloo" in out.stdout
    if WINDOWS:
        assert "nbdist_shm needs Linux on x86-64" in out.stdout, out.stdout
