"""DeepSpeed ZeRO 1-3 on Windows gloo (issue 26): ``deepspeed_zero1/2/3`` train like one process,
and ``nbdist.lightning.fit(strategy="deepspeed_stage_2")`` does too, within 1e-5.

DeepSpeed 0.19.8's sdist does not install on Windows (its setup.py lists ``bin/deepspeed.bat``,
which the sdist lacks: docs/platforms.md); scripts/windows-stack.sh installs the pure-Python wheel
built from that sdist on Linux. Without DeepSpeed these tests skip, saying so. They run on Linux
too, over spawn and pipes, as the smoke set does.
"""
import importlib.util
import sys

import cloudpickle
import pytest
import torch

from wingroup import windows_group  # tests/windows, on sys.path

NO_DEEPSPEED = ("DeepSpeed is not installed: its 0.19.8 sdist does not install on Windows "
                "(setup.py lists bin/deepspeed.bat, which the sdist lacks); "
                "scripts/windows-stack.sh installs the wheel built from it (docs/platforms.md)")
# find_spec, not import: nbdist picks DeepSpeed's accelerator when it first imports it
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason=NO_DEEPSPEED)
WINDOWS = sys.platform == "win32"
pytestmark = pytest.mark.timeout(300)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file

# As a notebook cell would define them: in __main__ on the ranks, so they travel by value.
SOURCE = '''
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

def toy_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return x, torch.tanh(x) @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

def make_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

def make_data():
    return DataLoader(TensorDataset(*toy_data()), batch_size=8)

class Toy(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()
    def training_step(self, batch, i):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
'''


@pytest.fixture(scope="module")
def g():
    """One group of 2 for the module, prepared for Lightning (a start under Wine is 20-35 s)."""
    pytest.importorskip("pytorch_lightning", reason="the Lightning test needs pytorch_lightning")
    import nbdist.lightning as nl

    with windows_group(timeout=120) as group:
        nl.prepare(group)  # before the ranks import Lightning
        group.exec(SOURCE)
        yield group


def train(name, steps=3):
    """The usual loop on this rank's half of each batch, and one process on the whole batches."""
    import copy
    import functools

    import torch.distributed as dist

    from nbdist import strategies

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    optimizer_fn = functools.partial(torch.optim.Adam, lr=1e-2)
    engine, opt = strategies.wrap(name, model, optimizer_fn)
    ref_opt = optimizer_fn(reference.parameters())
    losses, ref_losses = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(engine(xs), ys)
        loss.backward()
        opt.step()
        losses.append(loss.item() * xs.shape[0] / x.shape[0])  # this half's share of the whole
        ref_opt.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
    whole = torch.tensor(losses)
    dist.all_reduce(whole)
    full = strategies.full_parameters(engine)
    expected = dict(reference.named_parameters())
    return dict(engine=type(engine).__name__, whole=whole.tolist(), ref_losses=ref_losses,
                names=sorted(full) == sorted(expected),
                error=max((full[k] - expected[k]).abs().max().item() for k in expected),
                local=sum(getattr(p, "ds_tensor", p).numel() for p in engine.module.parameters()),
                total=sum(p.numel() for p in expected.values()))


@needs_deepspeed
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_trains_like_one_process(g, stage):
    out = g.run(train, f"deepspeed_zero{stage}")
    for rank in out:
        assert rank["engine"] == "DeepSpeedEngine" and rank["names"]
        assert rank["error"] < 1e-5, rank  # the same weights as one process, on every rank
        assert rank["whole"] == pytest.approx(rank["ref_losses"], abs=1e-5)
    if stage == 3:  # each rank holds half of the parameters
        assert [r["local"] * 2 for r in out] == [out[0]["total"]] * 2
    else:
        assert out[0]["local"] == out[0]["total"]


def one_process(ns, world=2, epochs=2, batch=8):
    """``Toy`` in one process, each step on the batches Lightning's DistributedSampler (shuffle,
    seed 0, set_epoch every epoch) deals to the ``world`` ranks together."""
    from torch.utils.data import DistributedSampler

    net = ns["make_net"]()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = ns["toy_data"]()
    samplers = [DistributedSampler(x, num_replicas=world, rank=r, shuffle=True, seed=0)
                for r in range(world)]
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        dealt = [list(sampler) for sampler in samplers]
        for start in range(0, len(dealt[0]), batch):
            index = torch.tensor([i for part in dealt for i in part[start:start + batch]])
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[index]), y[index]).backward()
            opt.step()
    return {"net." + k: v for k, v in net.state_dict().items()}


@needs_deepspeed
def test_lightning_fit_deepspeed_stage_2_matches_one_process(g, tmp_path):
    import nbdist.lightning as nl

    ns = {"__name__": "__main__"}
    exec(SOURCE, ns)  # the notebook's own copy of the cell
    results = nl.fit(g, ns["Toy"], ns["make_data"], "deepspeed_stage_2", weights="all",
                     max_epochs=2, default_root_dir=str(tmp_path), logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
    expected = one_process(ns)
    for r in results:
        assert r.global_step == 4 and sorted(r.state_dict) == sorted(expected)
        for k, v in expected.items():
            assert torch.allclose(r.state_dict[k], v, atol=1e-5), (r.rank, k)


def test_without_deepspeed_the_error_says_how_to_install_it_on_this_platform(monkeypatch):
    from nbdist import strategies

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    with pytest.raises(ImportError) as info:
        strategies.wrap("deepspeed_zero2", torch.nn.Linear(2, 2), torch.optim.SGD)
    text = str(info.value)
    assert text.startswith("the deepspeed_zero* strategies need DeepSpeed, an optional extra: "
                           "pip install nbdist[deepspeed]")
    windows = ("On Windows, pip cannot install DeepSpeed 0.19.8 from its sdist (its setup.py "
               "lists bin/deepspeed.bat, which the sdist lacks): build the wheel on Linux or WSL "
               "(pip wheel deepspeed==0.19.8 --no-deps) and pip install that "
               "deepspeed-0.19.8-py3-none-any.whl on Windows.")
    assert (windows in text) == WINDOWS, text
    assert text.endswith("'zero1', 'fsdp_grad_op' and 'fsdp' shard the same way without it.")
