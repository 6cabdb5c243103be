"""Training on CUDA: memory.measure against the ZeRO formulas (ddp, fsdp2, zero1), DeepSpeed ZeRO-2
on nccl, and a Lightning fit."""
import functools
import importlib.util

import pytest
import torch

from nbdist import memory, strategies

from gpu_checks import report

WIDTH = 256
PSI = 2 * (WIDTH * WIDTH + WIDTH)  # mlp(2, 256): two Linear layers


def _measured_meets_the_formula(group, name):
    world = group.world_size
    # on CUDA whatever the backend (gloo's default device is the CPU)
    rep = memory.measure(group, functools.partial(memory.mlp, 2, WIDTH), [name],
                         optimizer="adam", steps=2, batch=16, options={name: {"device": "cuda"}})
    assert [r.rank for r in rep] == list(range(world))
    for r in rep:
        assert r.device.startswith("cuda") and r.num_params == PSI
        assert r.peak is not None and r.peak > 0  # CUDA's allocator measures a peak
        assert r.estimate == memory.estimate(PSI, world, name).total
        assert abs(r.diff) < 0.02, (name, r.rank, r.diff, r.notes)
    r = rep[0]
    report(f"memory {name} on {group.backend}", world=world, params=r.params, grads=r.grads,
           optimizer=r.optimizer, peak=r.peak, estimate=r.estimate, diff=f"{r.diff:+.3%}")


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "zero1"])
def test_measured_memory_on_cuda_meets_the_formula(nccl_group, name):
    _measured_meets_the_formula(nccl_group, name)


@pytest.mark.parametrize("name", ["ddp", "zero1"])
def test_measured_memory_of_two_ranks_on_cuda_meets_the_formula(gpu_pair, world, name):
    """At one rank ddp, zero1 and fsdp2 all predict 16 bytes a parameter: two ranks tell them
    apart (on one GPU: gloo with CUDA tensors, both ranks on it)."""
    if world == 2:
        pytest.skip("the nccl group above has two ranks already")
    _measured_meets_the_formula(gpu_pair, name)


def _deepspeed_zero2(steps=3):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 8)).cuda()
    engine, opt = strategies.wrap("deepspeed_zero2", model,
                                  functools.partial(torch.optim.Adam, lr=1e-2))
    gen = torch.Generator().manual_seed(dist.get_rank())
    # one batch, fitted step after step: the loss falls on every rank (new random targets each
    # step need not, on any one rank)
    x, y = torch.randn(8, 64, generator=gen).cuda(), torch.randn(8, 8, generator=gen).cuda()
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, device=str(next(engine.module.parameters()).device))


def test_deepspeed_zero2_on_nccl(nccl_group, world):
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: seconds of the budget
        pytest.skip("DeepSpeed is not installed (pip install 'nbdist[deepspeed]')")
    out = nccl_group.run(_deepspeed_zero2)
    assert all(o["device"].startswith("cuda") for o in out)
    assert all(o["losses"][-1] < o["losses"][0] for o in out), out
    report("deepspeed zero2 on nccl", world=world, losses=[round(x, 4) for x in out[0]["losses"]])


LIGHTNING = '''
import torch, pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

class Toy(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)
    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
'''


def test_lightning_fit_on_cuda(nccl_group, world):
    nl = pytest.importorskip("nbdist.lightning")
    pytest.importorskip("pytorch_lightning")
    ns = {"__name__": "__main__"}
    exec(LIGHTNING, ns)
    nl.prepare(nccl_group)
    results = nl.fit(nccl_group, ns["Toy"], ns["make_data"], "ddp", max_epochs=2,
                     enable_progress_bar=False, logger=False, enable_checkpointing=False)
    assert len(results) == world
    loss = float(results[0].metrics["loss"])
    report("lightning fit on cuda", world=world, loss=f"{loss:.4f}")
