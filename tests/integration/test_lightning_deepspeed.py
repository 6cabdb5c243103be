"""DeepSpeed ZeRO 1-3 through Lightning on CPU ranks (issue 18, the Lightning part): losses and
weights against one process, stage-3 weights whole, the checkpoint read back in the kernel,
errors before anything runs, and the group usable afterwards."""
import os
import sys
import time

import pytest
import torch

import nbdist

pl = pytest.importorskip("pytorch_lightning")
pytest.importorskip("deepspeed")
import nbdist.lightning as nl  # noqa: E402

from lightning_cells import notebook, prepared_group  # noqa: E402 -- tests/integration, on sys.path

# As a notebook cell would define them: in __main__, so they travel by value.
SOURCE = '''
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

def toy_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return x, torch.tanh(x) @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

def make_net():
    torch.manual_seed(0)  # the same start on every rank and in the reference
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

def make_data():
    return DataLoader(TensorDataset(*toy_data()), batch_size=8)

class Toy(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()
    def training_step(self, batch, i):
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("loss", loss, sync_dist=True)  # the mean over the ranks: the global batch's
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

class Failing(Toy):
    def training_step(self, batch, i):
        raise ValueError("boom in a ZeRO-3 training_step")
'''

EPOCHS = 2
QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def nb():
    """The notebook's namespace: SOURCE run as ``__main__``."""
    return notebook(SOURCE)


@pytest.fixture(scope="module")
def g():
    with prepared_group(2, SOURCE) as group:
        yield group


def reference(nb, world, epochs=EPOCHS, batch=8):
    """One process on the global batches: each step, the ranks' batches together, as Lightning's
    DistributedSampler (shuffle=True, seed 0, set_epoch every epoch) deals them out."""
    from torch.utils.data import DistributedSampler

    net = nb["make_net"]()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = nb["toy_data"]()
    samplers = [DistributedSampler(x, num_replicas=world, rank=r, shuffle=True, seed=0)
                for r in range(world)]
    losses = []
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [list(sampler) for sampler in samplers]
        for start in range(0, len(per_rank[0]), batch):
            index = torch.tensor([i for rank in per_rank for i in rank[start:start + batch]])
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x[index]), y[index])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses, {"net." + k: v for k, v in net.state_dict().items()}


def fit_and_compare(group, nb, strategy, tmp_path, world=2, **kwargs):
    job = nl.fit(group, nb["Toy"], nb["make_data"], strategy, block=False, weights="all",
                 max_epochs=EPOCHS, default_root_dir=str(tmp_path), **QUIET, **kwargs)
    results = job.result(timeout=120)
    losses, weights = reference(nb, world)
    steps, logged = job.metrics.series("loss", 0)
    assert steps == list(range(1, len(losses) + 1))
    assert logged == pytest.approx(losses, abs=1e-5)
    for r in results:
        assert sorted(r.state_dict) == sorted(weights)
        for k, v in weights.items():
            assert r.state_dict[k].shape == v.shape  # stage 3 too: gathered, not (0,)
            assert torch.allclose(r.state_dict[k], v, atol=1e-5), (r.rank, k)
    return results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_matches_one_process_and_the_checkpoint_loads_back(g, nb, tmp_path, stage):
    results = fit_and_compare(g, nb, f"deepspeed_stage_{stage}", tmp_path)
    path = results[0].checkpoint_path
    assert os.path.isdir(path)  # DeepSpeed writes a directory, a shard per rank
    loaded = nl.load_zero_checkpoint(path)
    assert {k: v.shape for k, v in loaded.items()} == \
        {k: v.shape for k, v in results[0].state_dict.items()}
    assert all(torch.equal(loaded[k], v) for k, v in results[0].state_dict.items())
    module = nb["Toy"]()
    module.load_state_dict(loaded)
    assert torch.equal(module.net[0].weight, results[0].state_dict["net.0.weight"])


def test_plain_trainer_in_dist_cells_and_a_lightning_strategy_object(g, nb, tmp_path):
    out = g.exec("trainer = pl.Trainer(strategy='deepspeed_stage_3', devices=2, "
                 "accelerator='cpu', max_epochs=1, logger=False, enable_checkpointing=False, "
                 "enable_progress_bar=False, enable_model_summary=False)\n"
                 "model = Toy()\ntrainer.fit(model, make_data())\nimport deepspeed, sys\n"
                 "(type(trainer.strategy).__name__, trainer.strategy.config['zero_optimization'],"
                 " sum(p.ds_tensor.numel() for p in model.parameters()), "
                 "deepspeed.comm.comm.cdb.shm_comm_op, "
                 "'deepspeed_shm_comm' in sys.modules)")
    total = sum(p.numel() for p in nb["make_net"]().parameters())  # 97
    for name, zero, local, shm, built in out:
        assert name == "NbdistDeepSpeedStrategy"
        assert zero["stage3_param_persistence_threshold"] == 0  # small models partitioned too
        # max(largest parameter, a quarter of the model), not Lightning's 2e8 elements
        assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 64
        assert shm is None and not built  # no JIT build of DeepSpeed's shared-memory op
    assert sum(local for _, _, local, _, _ in out) in (total, total + 1)  # halves (padded)
    # Trainer.validate alone: DeepSpeed's inference engine, on the CPU too.
    val = g.exec("class Checked(Toy):\n"
                 "    def validation_step(self, batch, i):\n"
                 "        self.log('val', torch.nn.functional.mse_loss(self.net(batch[0]), "
                 "batch[1]), sync_dist=True)\n"
                 "pl.Trainer(strategy='deepspeed_stage_3', devices=2, accelerator='cpu', "
                 "logger=False, enable_progress_bar=False, enable_model_summary=False)"
                 ".validate(Checked(), make_data(), verbose=False)[0]['val']")
    net, (x, y) = nb["make_net"](), nb["toy_data"]()
    with torch.no_grad():
        assert val == [pytest.approx(torch.nn.functional.mse_loss(net(x), y).item(), abs=1e-5)] * 2
    # Lightning's own DeepSpeedStrategy object, made in the kernel: trains the same on the ranks.
    fit_and_compare(g, nb, pl.strategies.DeepSpeedStrategy(stage=2), tmp_path)


def test_errors_come_before_anything_runs_and_leave_the_group_usable(g, nb, monkeypatch):
    with pytest.raises(ValueError, match="precision='16-mixed' with DeepSpeed does not work on "
                                         "the CPU.*'bf16-mixed'"):
        nl.fit(g, nb["Toy"], nb["make_data"], "deepspeed_stage_2", precision="16-mixed")
    with pytest.raises(nbdist.RemoteError, match="precision='16-mixed' with DeepSpeed does not "
                                                 "work on the CPU"):
        g.exec("pl.Trainer(strategy='deepspeed_stage_1', devices=2, accelerator='cpu', "
               "precision='16-mixed', logger=False).fit(Toy(), make_data())")
    with pytest.raises(nbdist.RemoteError, match="boom in a ZeRO-3 training_step"):
        nl.fit(g, nb["Failing"], nb["make_data"], "deepspeed_stage_3", max_epochs=1,
               enable_checkpointing=False, **QUIET)
    lightnings = pl.strategies.DeepSpeedStrategy(stage=2)  # made while DeepSpeed is there
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
        with pytest.raises(ImportError, match="strategy='deepspeed_stage_3' needs DeepSpeed, an "
                                              "optional extra: pip install nbdist\\[deepspeed\\]"):
            nl.fit(g, nb["Toy"], nb["make_data"], "deepspeed_stage_3")
        with pytest.raises(ImportError, match="^DeepSpeedStrategy needs DeepSpeed, an optional "
                                              "extra: pip install nbdist\\[deepspeed\\] .*"
                                              "Without it, strategy='fsdp2' shards like ZeRO-3"):
            nl.fit(g, nb["Toy"], nb["make_data"], lightnings)
        with pytest.raises(ImportError, match="reading a DeepSpeed checkpoint needs DeepSpeed"):
            nl.load_zero_checkpoint("nowhere")
    assert g.run(lambda: torch.distributed.get_backend()) == ["gloo", "gloo"]
    results = nl.fit(g, nb["Toy"], nb["make_data"], "deepspeed_stage_3", max_epochs=1,
                     enable_checkpointing=False, **QUIET)
    assert [r.global_step for r in results] == [4, 4]


def test_another_process_group_backend_for_the_fit_then_back(g, nb, tmp_path, capsys):
    # The ranks re-form their process group with nbdist_shm for the fit: DeepSpeed's cached
    # groups from the earlier fits are stale then, and are made again.
    results = fit_and_compare(g, nb, "deepspeed_stage_3", tmp_path / "shm",
                              process_group_backend="nbdist_shm")
    assert [r.backend for r in results] == ["nbdist_shm", "nbdist_shm"]
    assert "re-form their process group with 'nbdist_shm'" in capsys.readouterr().out
    assert g.run(lambda: torch.distributed.get_backend()) == ["gloo", "gloo"]
    fit_and_compare(g, nb, "deepspeed_stage_2", tmp_path / "gloo")  # and back on gloo


@pytest.mark.timeout(360)
def test_each_stage_on_four_ranks(nb, tmp_path):
    # one group of 4 for the three stages, by name and (stage 3) as a strategy object
    start = time.monotonic()
    with prepared_group(4, SOURCE, timeout=90) as group:
        for stage in (1, 2):
            fit_and_compare(group, nb, f"deepspeed_stage_{stage}", tmp_path / str(stage), world=4)
        fit_and_compare(group, nb, nl.NbdistDeepSpeedStrategy(stage=3), tmp_path / "3", world=4)
    assert time.monotonic() - start < 300


def test_bf16_mixed_trains_close_to_fp32(g, nb):
    job = nl.fit(g, nb["Toy"], nb["make_data"], "deepspeed_stage_3", block=False,
                 precision="bf16-mixed", max_epochs=EPOCHS, enable_checkpointing=False, **QUIET)
    results = job.result(timeout=120)
    assert results[0].state_dict["net.0.weight"].dtype == torch.bfloat16
    assert job.metrics.series("loss", 0)[1] == pytest.approx(reference(nb, 2)[0], rel=2e-2)
