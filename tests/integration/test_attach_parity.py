"""An attached group is a first-class group (issue 20): the public features that work on a local
group, run on ONE group whose ranks two real torchrun "nodes" (1 rank each) started on this
machine, attached with ``nbdist.attach`` (backend "auto", resolved on the ranks)."""
import sys
import time

import cloudpickle
import pytest
import torch
from attach_helpers import Cluster
from IPython.testing import globalipapp
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

import nbdist
from nbdist import memory, strategies
from nbdist.bench import Trace
from nbdist.errors import GroupClosedError, NbdistError
from nbdist.runtime.attach import agreed_choice
from nbdist.backends.resolve import BackendChoice
from nbdist.ui import magics

pytestmark = pytest.mark.timeout(240)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two torchrun nodes x 1 rank, attached; the agents must exit 0 after the clean stop."""
    c = Cluster(tmp_path_factory.mktemp("parity"), nnodes=2, nproc=1)
    try:
        yield c
    finally:
        nbdist.use_group(None)
        codes = c.close()
    assert codes == [0, 0], f"torchrun agents after a clean stop: {codes}"


@pytest.fixture
def g(cluster):
    """The attached group, current for magics and panels during the test."""
    assert cluster.group.state == "ready", "an earlier test broke the attached group"
    nbdist.use_group(cluster.group)
    yield cluster.group
    nbdist.use_group(None)


# ---- "auto" resolved on the ranks, node labels ---------------------------------------------------
def test_auto_is_resolved_on_the_ranks_and_reported(g):
    assert (g.backend, g.device) == ("gloo", "cpu")
    assert "backend='gloo', device='cpu'" in repr(g)
    status = g.status()
    assert [r.node for r in status.ranks] == ["0", "1"]  # torchrun's GROUP_RANK
    text = str(status)
    assert "node" in text.splitlines()[1] and "device cpu" in text
    assert g.exec("str(device)") == ["cpu", "cpu"]  # the ranks' own view agrees


def test_ranks_that_resolve_auto_differently_are_named():
    infos = {0: {"backend": "cpu:gloo,cuda:gloo", "device": "cpu"},
             1: {"backend": "cpu:gloo,cuda:nccl", "device": "cuda"},
             2: {"backend": "cpu:gloo,cuda:gloo", "device": "cpu"}}
    with pytest.raises(NbdistError, match=r"resolved backend/device 'auto' differently \(ranks 0, "
                                          r"2: backend gloo, device cpu; rank 1: backend "
                                          r"cpu:gloo,cuda:nccl, device cuda\)"):
        agreed_choice(BackendChoice("auto", "auto"), infos)
    named = agreed_choice(BackendChoice("gloo", "auto"), {0: infos[0]})
    assert (named.backend, named.device) == ("gloo", "cpu")


# ---- run / exec / push / pull --------------------------------------------------------------------
def test_run_exec_push_pull(g):
    assert g.run(lambda: torch.distributed.get_rank()) == [0, 1]
    assert g.exec("y = rank * 10\ny + world_size") == [2, 12]
    g.push(t=torch.arange(4.0))
    g.push({"only": 7}, ranks=[1])
    assert g.exec("t.sum().item() + globals().get('only', 0)") == [6.0, 13.0]
    assert [v.tolist() for v in g.pull("t")] == [[0.0, 1.0, 2.0, 3.0]] * 2
    assert g.pull("y", "t", ranks=[1])[0][0] == 10
    big = torch.randn(256, 1024)  # 1 MiB: not through shared memory, the ranks are "remote"
    g.push(big=big)
    assert all(torch.equal(v, big) for v in g.pull("big"))


# ---- the magics ----------------------------------------------------------------------------------
def _cell(shell, line, cell):
    with capture_output() as captured:
        result = shell.run_cell(f"%%dist {line}\n{cell}")
    return result, captured


def test_dist_magic_and_its_flags(g):
    shell = start_ipython() or globalipapp.get_ipython()  # one test shell per process
    shell.display_formatter.active_types = shell.display_formatter.format_types
    shell.run_line_magic("load_ext", "nbdist")
    try:
        magics.use_group(g)
        _, out = _cell(shell, "", "print('hello from', rank)\nrank * 3")
        shown = [o.data.get("text/plain") for o in out.outputs]
        assert shown == ["Out[rank 0]: 0", "Out[rank 1]: 3"]
        assert "hello from" in out.stdout
        _, out = _cell(shell, "--ranks 1 -q", "z = 5\nz")
        assert out.outputs == []
        assert g.exec("globals().get('z')") == [None, 5]
        _, out = _cell(shell, "--all-output", "print('same line')")
        assert out.stdout.count("same line") == 2
        _, out = _cell(shell, "--trace -q", "t = torch.ones(4)\ndist.all_reduce(t)")
        assert "all_reduce" in "".join(o.data.get("text/plain", "") for o in out.outputs)
        _, out = _cell(shell, "--timeout 30", "rank")
        assert [o.data.get("text/plain") for o in out.outputs] == ["Out[rank 0]: 0",
                                                                   "Out[rank 1]: 1"]
        job = shell.run_cell_magic("dist", "--bg attached_job -q", "import time; time.sleep(0.2)")
        assert job.result(timeout=60) == [None, None]
        shell.user_ns["kernel_value"] = 41
        shell.run_line_magic("dist_push", "kernel_value")
        shell.run_line_magic("dist_pull", "y --rank 1")
        assert shell.user_ns["y"] == 10 and g.exec("kernel_value + 1") == [42, 42]
        with capture_output() as captured:
            shell.run_line_magic("dist_status", "")
        assert "node" in captured.stdout + "".join(o.data.get("text/plain", "")
                                                   for o in captured.outputs)
    finally:
        shell.run_line_magic("unload_ext", "nbdist")  # as the notebooks' session shell expects


# ---- benchmarks and traces -----------------------------------------------------------------------
def _traced():
    import torch.distributed as dist

    import nbdist.bench

    with nbdist.bench.trace() as tr:
        t = torch.ones(1000)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
    return tr


def test_collective_benchmark_and_trace(g):
    out = nbdist.bench.collectives(g, ops="all_reduce,barrier", sizes="4K", iters=2, warmup=1,
                                   progress=False)
    assert {r["op"] for r in out} == {"all_reduce", "barrier"}
    assert all(r["status"] == "ok" for r in out)
    tr = Trace.merge(g.run(_traced))
    assert set(tr.spans) == {0, 1}
    assert sorted({e["op"] for e in tr}) == ["all_reduce", "broadcast"]


# ---- memory, strategies, Lightning ---------------------------------------------------------------
def _small():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_memory_measure_ddp_and_fsdp(g):
    rep = memory.measure(g, _small, ["ddp", "fsdp"], optimizer="sgd", steps=1, batch=8)
    by = {(r.strategy, r.rank): r for r in rep}
    assert set(by) == {(s, r) for s in ("ddp", "fsdp") for r in (0, 1)}
    psi = sum(p.numel() for p in _small().parameters())
    assert all(by[("ddp", r)].params == 4 * psi for r in (0, 1))
    assert all(by[("fsdp", r)].params == 2 * psi for r in (0, 1))  # sharded across the two nodes
    assert all(abs(r.diff) < 0.02 for r in rep)


def _train(name, steps=3):
    import copy
    import functools

    import torch.distributed as dist

    torch.manual_seed(0)
    model = _small()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    xs, ys = x.chunk(dist.get_world_size())[dist.get_rank()], y.chunk(dist.get_world_size())[
        dist.get_rank()]
    optimizer_fn = functools.partial(torch.optim.SGD, lr=0.1)
    wrapped, opt = strategies.wrap(name, model, optimizer_fn)
    ref_opt = optimizer_fn(reference.parameters())
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(xs), ys).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    full = strategies.full_parameters(wrapped)
    return max((full[k] - p).abs().max().item() for k, p in reference.named_parameters())


@pytest.mark.parametrize("name", ["ddp", "zero1"])
def test_strategies_train_like_a_local_run(g, name):
    # the same weights as one process training on the whole batch, as on a local group
    assert all(err < 1e-5 for err in g.run(_train, name))


LIGHTNING = '''
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss, sync_dist=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
'''


def test_lightning_fit_one_epoch(g, tmp_path):
    pytest.importorskip("pytorch_lightning")
    import nbdist.lightning as nl

    nb = {"__name__": "__main__"}
    exec(LIGHTNING, nb)
    results = nl.fit(g, nb["Tiny"], nb["make_data"], "ddp", max_epochs=1, logger=False,
                     default_root_dir=str(tmp_path), enable_progress_bar=False,
                     enable_checkpointing=False, enable_model_summary=False)
    assert [r.rank for r in results] == [0, 1]
    assert all(r.global_step == 2 and r.backend == "gloo" for r in results)  # 16 samples x 1 epoch
    assert results[0].metrics["loss"] == results[1].metrics["loss"]


# ---- the launcher panel --------------------------------------------------------------------------
def test_launcher_panel_shows_hosts_nodes_and_why_restart_is_off(g):
    import socket

    from nbdist.ui.widgets import launcher

    ui = launcher(refresh_interval=60)
    try:
        assert (ui.world_size, ui.backend, ui.device) == (2, "gloo", "cpu")
        table = ui._table.value
        assert "<th style='text-align:left;padding-right:1em'>node</th>" in table
        assert table.count(f">{socket.gethostname()}</td>") == 2
        assert "nbdist-col-node'>0</td>" in table and "nbdist-col-node'>1</td>" in table
        assert ui.buttons["restart"].disabled and not ui.buttons["stop"].disabled
        assert "cannot restart them" in ui.buttons["restart"].tooltip
        assert "Restart is off: the ranks of an attached group" in table
        ui._press("restart")  # pressed anyway (e.g. by code): the reason, and the group is intact
        assert "cannot restart them" in ui._feedback.value
        with pytest.raises(GroupClosedError, match="cannot restart them"):
            g.restart()
    finally:
        ui.close()
    assert g.state == "ready"


# ---- background jobs and metrics -----------------------------------------------------------------
def _logged(steps):
    import torch.distributed as dist

    import nbdist

    for i in range(steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        nbdist.log(step=i, loss=1.0 / (i + 1), world=t.sum())
    return dist.get_rank()


def test_background_job_and_metrics(g):
    job = g.submit(_logged, 10)
    assert job.result(timeout=60) == [0, 1]
    assert len(job.metrics) == 10 * 2 * 2  # 10 steps x 2 names (loss, world) x 2 ranks
    last = job.metrics.last()
    assert last[0]["loss"] == (9, pytest.approx(0.1)) and last[1]["world"] == (9, 2.0)
    deadline = time.monotonic() + 10
    while g.job is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert g.run(lambda: 1) == [1, 1]
