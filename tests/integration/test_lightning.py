"""Lightning inside nbdist ranks (issue 8): plain Trainer in exec cells, nbdist.lightning.fit."""
import os
import subprocess
import sys

import pytest
import torch

import nbdist

pl = pytest.importorskip("pytorch_lightning")
import nbdist.lightning as nl  # noqa: E402

from lightning_cells import (notebook, one_process_on_lightning_batches,  # noqa: E402,I001
                             prepared_group)

# Models and data as a notebook cell would define them: in __main__, so they travel by value.
SOURCE = '''
import os
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

def toy_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

def make_data():
    return DataLoader(TensorDataset(*toy_data()), batch_size=8)

class Toy(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(int(os.environ.get("RANK", "0")))  # ranks start different
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        self.seen = 0
    def loss(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)
    def training_step(self, batch, i):
        self.seen += len(batch[0])
        loss = self.loss(*batch)
        self.log("loss", loss, sync_dist=True)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

class Sharded(Toy):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

class TensorParallel(Toy):
    def __init__(self):  # tensor parallel slices each rank's own copy: the same start everywhere
        os.environ["RANK"], rank = "0", os.environ.get("RANK", "0")
        super().__init__()
        os.environ["RANK"] = rank
    def configure_model(self):
        from nbdist.parallel import tensor_parallel
        tensor_parallel(self.net, self.device_mesh["tensor_parallel"])

class Failing(Toy):
    def training_step(self, batch, i):
        raise ValueError("boom in training_step")
'''

TRAINER = "accelerator='cpu', max_epochs=2, logger=False, enable_checkpointing=False"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def nb():
    """The notebook's namespace: SOURCE run as ``__main__``."""
    return notebook(SOURCE)


@pytest.fixture(scope="module")
def g():
    """One 2-rank gloo group for the module, with the Lightning guards and SOURCE on the ranks."""
    with prepared_group(2, SOURCE, timeout=30) as group:
        yield group


@pytest.fixture(scope="module")
def gloowrap():
    """A custom backend registered in the kernel: ProcessGroupGloo behind a creator of our own."""
    def creator(store, rank, size, timeout):
        import torch.distributed as dist
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    nbdist.register_backend("gloowrap", creator, devices=["cpu"], replace=True)
    yield "gloowrap"
    nbdist.backends.unregister_backend("gloowrap")


def _loss(nb, module):
    with torch.no_grad():
        return float(module.loss(*nb["toy_data"]()))


def _same_weights(states):
    return all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])


@pytest.mark.timeout(60)
def test_import_nbdist_does_not_import_lightning():
    code = ("import sys, nbdist, nbdist.lightning; "
            "assert 'pytorch_lightning' not in sys.modules and 'lightning' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_plain_trainer_in_dist_cells(g, tmp_path):
    lines = []
    g.output = lambda rank, stream, text: lines.append((rank, text))
    try:
        out = g.exec(f"trainer = pl.Trainer(strategy='ddp', devices=2, {TRAINER}, "
                     f"default_root_dir={str(tmp_path)!r})\n"
                     "model = Toy()\ntrainer.fit(model, make_data())\n"
                     "(type(trainer.strategy.cluster_environment).__name__, model.seen, "
                     "os.environ.get('WORLD_SIZE'), "
                     "[p.detach().clone() for p in model.parameters()])")
    finally:
        g.output = None
    for env, seen, world, _ in out:
        assert (env, seen, world) == ("NbdistEnvironment", 64, "2")  # 32 samples x 2 epochs
    assert all(torch.equal(a, b) for a, b in zip(out[0][3], out[1][3]))
    rank1 = "\n".join(text for rank, text in lines if rank == 1)
    rank0 = "\n".join(text for rank, text in lines if rank == 0)
    assert "Epoch 1" in rank0 and "Total params" in rank0
    assert "Epoch" not in rank1 and "Total params" not in rank1
    # The same group trains again, also with the plugin passed explicitly, and stays usable.
    seen = g.exec("import nbdist.lightning\n"
                  f"trainer = pl.Trainer(strategy='ddp', devices=2, {TRAINER}, "
                  "plugins=[nbdist.lightning.NbdistEnvironment()], enable_progress_bar=False)\n"
                  "model = Toy()\ntrainer.fit(model, make_data())\n"
                  "model.seen")
    assert seen == [64, 64]
    assert g.run(lambda: torch.distributed.get_world_size()) == [2, 2]


def test_lightnings_info_lines_go_to_stdout_its_warnings_to_stderr(g, tmp_path):
    """Lightning logs "GPU available: False" and "`Trainer.fit` stopped" at INFO through a handler
    of its own on stderr, which a notebook shows as an error (issue 28). On the ranks, INFO goes
    to stdout; warnings stay on stderr."""
    lines = []
    g.output = lambda rank, stream, text: lines.append((stream, text))
    try:
        g.exec(f"trainer = pl.Trainer(strategy='ddp', devices=2, {TRAINER}, "
               f"enable_progress_bar=False, default_root_dir={str(tmp_path)!r})\n"
               "trainer.fit(Toy(), make_data())\nimport logging\n"
               "logging.getLogger(pl.__name__).warning('a warning stays on stderr')")
    finally:
        g.output = None
    said = {name: "".join(text for stream, text in lines if stream == name)
            for name in ("stdout", "stderr")}
    assert "GPU available" in said["stdout"] and "fit` stopped" in said["stdout"], said
    assert "GPU available" not in said["stderr"] and "fit` stopped" not in said["stderr"], said
    assert "a warning stays on stderr" in said["stderr"], said


def test_fit_ddp_learns_returns_weights_and_runs_twice(g, nb, tmp_path):
    kwargs = dict(max_epochs=3, logger=False, default_root_dir=str(tmp_path),
                  enable_progress_bar=False)
    results = nl.fit(g, nb["Toy"], nb["make_data"], "ddp", weights="all", **kwargs)
    assert [r.rank for r in results] == [0, 1]
    assert all(r.global_step == 12 and r.backend == "gloo" for r in results)  # 4 steps x 3 epochs
    assert _same_weights([r.state_dict for r in results])
    assert os.path.exists(results[0].checkpoint_path)
    assert results[0].metrics["loss"] == results[1].metrics["loss"]  # sync_dist
    before = _loss(nb, nb["Toy"]())
    trained = results[0].load_into(nb["Toy"]())
    assert _loss(nb, trained) < before
    again = nl.fit(g, nb["Toy"], nb["make_data"], **kwargs)  # default: weights on rank 0 only
    assert again[0].state_dict is not None and again[1].state_dict is None
    with pytest.raises(ValueError, match="rank 1 returned no weights"):
        again[1].load_into(nb["Toy"]())


def test_fit_with_a_custom_backend_then_back(g, nb, gloowrap, capsys):
    results = nl.fit(g, nb["Toy"], nb["make_data"], "ddp", process_group_backend=gloowrap,
                     max_epochs=2, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False)
    assert [r.backend for r in results] == ["gloowrap", "gloowrap"]
    assert results[0].global_step == 8
    assert "re-form their process group with 'gloowrap'" in capsys.readouterr().out
    assert g.run(lambda: torch.distributed.get_backend()) == ["gloo", "gloo"]
    assert g.run(lambda: torch.distributed.all_reduce(torch.ones(1)) or 1) == [1, 1]
    # A device:backend mapping string is honoured too.
    mapped = nl.fit(g, nb["Toy"], nb["make_data"], process_group_backend="cpu:gloo", max_epochs=1,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert [r.backend for r in mapped] == ["cpu:gloo", "cpu:gloo"]
    assert g.run(lambda: torch.distributed.get_backend()) == ["gloo", "gloo"]


def test_tensor_parallel_through_lightning_matches_one_process(g, nb):
    """strategy="tp": Lightning's ModelParallelStrategy with tensor_parallel_size = the world;
    the module applies nbdist.parallel.tensor_parallel in configure_model. Every rank sees every
    batch (data parallel size 1), so the weights are those of one process on the same batches."""
    results = nl.fit(g, nb["TensorParallel"], nb["make_data"], "tp", weights="all", max_epochs=2,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert [r.global_step for r in results] == [16, 16]  # all 8 batches per epoch on each rank
    ref = one_process_on_lightning_batches(nb, dp=1)
    for state in (r.state_dict for r in results):
        for name, value in ref.state_dict().items():
            assert torch.allclose(state[name].float(), value, atol=1e-5), name


def test_fsdp2_on_cpu(g, nb):
    before = _loss(nb, nb["Toy"]())
    results = nl.fit(g, nb["Sharded"], nb["make_data"], "fsdp2", weights="all", max_epochs=3,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert [r.global_step for r in results] == [12, 12]  # data split two ways, not one
    assert _same_weights([r.state_dict for r in results])
    assert _loss(nb, results[0].load_into(nb["Toy"]())) < before


def test_failed_fit_leaves_group_usable(g, nb, gloowrap):
    for backend in (None, gloowrap):
        with pytest.raises(nbdist.RemoteError, match="boom in training_step"):
            nl.fit(g, nb["Failing"], nb["make_data"], process_group_backend=backend,
                   max_epochs=1, logger=False, enable_checkpointing=False)
        assert g.run(lambda: torch.distributed.get_backend()) == ["gloo", "gloo"]
    results = nl.fit(g, nb["Toy"], nb["make_data"], max_epochs=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False)
    assert results[0].global_step == 4


@pytest.mark.timeout(120)
def test_a_fit_backend_one_rank_cannot_start_leaves_the_group_on_its_own(nb):
    """Rank 1's creator refuses: rank 0 waits for it until the process-group timeout (5 s here).
    Both then go back to the group's backend, so the next call's collective works (it used to find
    no default process group at all, with the group saying "ready"). Rank 0 comes 3 s late, as a
    loaded machine made it: rank 1 is back home before rank 0 even starts the fit's process group
    (the ranks used to count their re-forms in one shared counter, and then met under different
    prefixes: rank 1 reported "Wait timeout" after 20 s)."""
    def creator(store, rank, size, timeout):
        import torch.distributed as dist
        if rank == 1:
            raise RuntimeError("creator refuses rank 1")
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    nbdist.register_backend("halfgloo", creator, devices=["cpu"], replace=True)
    try:
        with prepared_group(2, SOURCE, timeout=5) as group:
            group.exec("import importlib, time\n"
                       "nlfit = importlib.import_module('nbdist.lightning.fit')\n"
                       "if rank == 0:\n"
                       "    _on_time = nlfit._rendezvous\n"
                       "    nlfit._rendezvous = lambda: (time.sleep(3), _on_time())[1]")
            with pytest.raises(nbdist.RemoteError) as info:
                nl.fit(group, nb["Toy"], nb["make_data"], process_group_backend="halfgloo",
                       max_epochs=1, logger=False, enable_checkpointing=False)
            # both ranks fail (rank 0 waits for rank 1 until the timeout); both reply only once
            # back on the group's backend, so which counts as the root cause varies
            assert info.value.failures[1].message == "creator refuses rank 1"
            assert info.value.ranks == [0, 1]
            assert group.state == "ready"
            assert group.exec("t = torch.ones(1); dist.all_reduce(t); (dist.get_backend(), "
                              "t.item())") == [("gloo", 2.0)] * 2
    finally:
        nbdist.backends.unregister_backend("halfgloo")


@pytest.mark.parametrize("devices, strategy, harm", [
    (4, "ddp", "split the data 4 ways"), (1, "ddp", "not train as one job"),
    (1, "auto", "not train as one job")])
def test_trainer_with_wrong_device_count_is_an_error(g, devices, strategy, harm):
    match = f"set up for {devices} process.*2 ranks: .*{harm}"
    with pytest.raises(nbdist.RemoteError, match=match):
        g.exec(f"pl.Trainer(strategy={strategy!r}, devices={devices}, {TRAINER})")


def test_spawning_strategies_are_refused(g, nb):
    for name in ("ddp_spawn", "ddp_fork", "ddp_notebook"):
        with pytest.raises(nbdist.RemoteError,
                           match=f"own worker processes \\(strategy='{name}'\\).*strategy='ddp'"):
            g.exec(f"pl.Trainer(strategy={name!r}, devices=2, {TRAINER})")
        with pytest.raises(ValueError, match=f"strategy='{name}'.*devices=2"):
            nl.fit(g, nb["Toy"], nb["make_data"], name)


def test_launching_child_scripts_is_refused(g):
    # Without LOCAL_RANK, Lightning's default environment would re-run the command line.
    src = ("from lightning_fabric.plugins.environments import LightningEnvironment\n"
           "os.environ.pop('LOCAL_RANK')\n"
           "try:\n"
           f"    trainer = pl.Trainer(strategy='ddp', devices=2, {TRAINER}, "
           "plugins=[LightningEnvironment()])\n"
           "    trainer.fit(Toy(), make_data())\n"
           "finally:\n"
           "    os.environ.update(LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))\n")
    with pytest.raises(nbdist.RemoteError, match="1 more copies of this script"):
        g.exec(src)
    assert g.run(lambda: os.environ["LOCAL_RANK"]) == ["0", "1"]


def test_other_process_group_backend_in_a_plain_trainer_is_an_error(g):
    with pytest.raises(nbdist.RemoteError, match="process_group_backend='gloowrap'.*uses 'gloo'"):
        g.exec("pl.Trainer(strategy=pl.strategies.DDPStrategy(process_group_backend='gloowrap'), "
               f"devices=2, {TRAINER})")


def test_lightning_refusals_arrive_as_clean_errors(g):
    with pytest.raises(nbdist.RemoteError, match="requires a GPU accelerator"):
        g.exec(f"pl.Trainer(strategy='fsdp', devices=2, {TRAINER})")


def test_fit_argument_errors(g, nb):
    with pytest.raises(ValueError, match="Lightning's FSDPStrategy, which needs CUDA.*'fsdp2'"):
        nl.fit(g, nb["Toy"], nb["make_data"], "fsdp")
    with pytest.MonkeyPatch.context() as patch:  # DeepSpeed on CPU: test_lightning_deepspeed.py
        patch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
        with pytest.raises(ImportError, match="strategy='deepspeed' needs DeepSpeed, an optional"):
            nl.fit(g, nb["Toy"], nb["make_data"], "deepspeed")
    with pytest.raises(ValueError, match="weights must be one of"):
        nl.fit(g, nb["Toy"], nb["make_data"], weights="some")
    with pytest.raises(TypeError, match="must be callables"):
        nl.fit(g, nb["Toy"](), nb["make_data"])
    with pytest.raises(ValueError, match="strategy object says process_group_backend='gloo'"):
        own = pl.strategies.DDPStrategy(process_group_backend="gloo")
        nl.fit(g, nb["Toy"], nb["make_data"], own, process_group_backend="nccl")
    with pytest.raises(nbdist.BackendError, match="unknown backend 'nosuch'"):
        nl.fit(g, nb["Toy"], nb["make_data"], process_group_backend="nosuch")
    from lightning_fabric.plugins.environments import ClusterEnvironment
    assert issubclass(nl.NbdistEnvironment, ClusterEnvironment)
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        nl.Nope


@pytest.mark.timeout(90)
def test_fit_in_the_background_streams_what_the_module_logs(g, nb, tmp_path):
    job = nl.fit(g, nb["Toy"], nb["make_data"], "ddp", block=False, max_epochs=3, logger=False,
                 default_root_dir=str(tmp_path), enable_progress_bar=False)
    assert isinstance(job, nbdist.Job)
    results = job.result(timeout=80)
    assert [r.global_step for r in results] == [12, 12]
    losses = [row for row in job.metrics if row["name"] == "loss"]
    assert {row["rank"] for row in losses} == {0, 1}
    assert max(row["step"] for row in losses) == 12  # one row per training batch, at its step
    assert job.metrics.last()[0]["loss"][1] == pytest.approx(results[0].metrics["loss"])


def test_no_slurm_hint_on_a_rank_with_srun_on_its_path(g, tmp_path):
    """The group is the cluster environment: a machine with ``srun`` installed does not get
    SLURM's "prepend your python command with srun" warning on the ranks, which Lightning checks
    when it builds a Trainer and again at every fit (tutorial 05 showed it, issue 35's review)."""
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    said = g.exec(
        "import warnings\nold = os.environ['PATH']\n"
        f"os.environ['PATH'] = {str(tmp_path)!r} + os.pathsep + old\n"
        "try:\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        f"        trainer = pl.Trainer(strategy='ddp', devices=2, {TRAINER}, "
        "enable_progress_bar=False)\n"
        "        trainer.fit(Toy(), make_data())\n"
        "finally:\n    os.environ['PATH'] = old\n"
        "(type(trainer.strategy.cluster_environment).__name__, "
        "[str(w.message) for w in seen if 'srun' in str(w.message)])")
    assert said == [("NbdistEnvironment", [])] * 2, said
    # outside a group Lightning's detection runs as it always does: the hint is its own
    import shutil
    import pytorch_lightning as pl
    from unittest import mock
    with mock.patch.object(shutil, "which", lambda name: str(fake)), \
            pytest.warns(UserWarning, match="srun"):
        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
