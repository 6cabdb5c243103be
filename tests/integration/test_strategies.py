"""Strategies train on real ranks (2, gloo) and agree with single-process training (issue 6)."""
import sys

import cloudpickle
import pytest
import torch

import nbdist
from nbdist import strategies

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file

REPLICATED = ["ddp", "zero1", "fairscale_oss", "fairscale_sharded"]
SHARDED = ["fsdp_grad_op", "fsdp", "fsdp2"]


@pytest.fixture(scope="module", params=["forkserver", "spawn"])
def shared_group(request):
    """The module's group, once per start method (spawn is the Windows path, issue 20)."""
    with nbdist.start(2, backend="gloo", device="cpu", timeout=30,
                      start_method=request.param) as g:
        yield g


def train(name, precision="fp32", steps=4):
    """Train a small MLP on this rank's half of a batch; compare with full-batch training."""
    import copy
    import functools

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    optimizer_fn = functools.partial(torch.optim.Adam, lr=1e-2)
    wrapped, opt = strategies.wrap(name, model, optimizer_fn, precision=precision)
    ref_opt = optimizer_fn(reference.parameters())
    losses, out = [], None
    for _ in range(steps):
        opt.zero_grad()  # torch's default set_to_none=True, as users write it
        out = wrapped(xs)
        loss = torch.nn.functional.mse_loss(out.float(), ys)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    full = strategies.full_parameters(wrapped)
    expected = dict(reference.named_parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in wrapped.parameters()]
    return dict(losses=losses, names=sorted(full), expected_names=sorted(expected),
                error=max((full[k] - expected[k]).abs().max().item() for k in expected),
                local_numel=sum(p.numel() for p in local),
                total=sum(p.numel() for p in expected.values()),
                local=[p.detach().clone() for p in local], out_dtype=out.dtype)


@pytest.mark.parametrize("name", REPLICATED + SHARDED)
def test_strategy_trains_like_one_process_on_the_whole_batch(shared_group, name):
    out = shared_group.run(train, name)
    for rank in out:
        assert rank["losses"][-1] < rank["losses"][0], rank["losses"]
        assert rank["names"] == rank["expected_names"]
        assert rank["error"] < 1e-5  # same weights as full-batch training, on every rank
        assert rank["out_dtype"] == torch.float32
    if name in REPLICATED:  # every rank holds the whole model, bit for bit the same
        assert out[0]["local_numel"] == out[0]["total"]
        assert all(torch.equal(a, b) for a, b in zip(out[0]["local"], out[1]["local"]))
    else:  # each rank holds half of the parameters
        assert [r["local_numel"] * 2 for r in out] == [out[0]["total"]] * 2


@pytest.mark.parametrize("name", SHARDED)
def test_bf16_mixed_precision_where_the_strategy_has_it(shared_group, name):
    for rank in shared_group.run(train, name, "bf16-mixed"):
        assert rank["out_dtype"] == torch.bfloat16  # the forward ran in bf16
        assert rank["losses"][-1] < rank["losses"][0]
        assert 0 < rank["error"] < 1e-2  # fp32 master weights, close to the fp32 run


def bucket_views(options):
    model, _ = strategies.wrap("ddp", torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1),
                               **options)
    return model.gradient_as_bucket_view


def test_ddp_uses_gradient_bucket_views_unless_told_otherwise(shared_group):
    assert shared_group.run(bucket_views, {}) == [True, True]
    assert shared_group.run(bucket_views, {"gradient_as_bucket_view": False}) == [False, False]


@pytest.mark.parametrize("name,kwargs,error,text", [
    ("ddp", dict(precision="fp16"), ValueError, "precision must be one of fp32, bf16-mixed, got "
     "'fp16'"),
    ("ddp", dict(precision="bf16-mixed"), ValueError, "strategy 'ddp' has no built-in bf16-mixed "
     "mixed precision; keep precision='fp32' and run the forward under torch.autocast"),
    ("zero1", dict(optimizer_fn="adam"), TypeError, "optimizer_fn must build the optimizer from "
     "parameters, e.g. torch.optim.Adam"),
    ("fairscale_fsdp", {}, ValueError, "strategy 'fairscale_fsdp' needs CUDA: fairscale's "
     "FullyShardedDataParallel keeps its full parameters on the GPU (device here: cpu). On CPU use "
     "'fsdp' or 'fsdp2'"),
    ("ddp", {}, RuntimeError, "wrap() needs torch.distributed initialised: call it on the ranks"),
    ("zero3", {}, ValueError, "'zero3' not found in the strategy registry. Available names: ddp, "),
])
def test_wrap_explains_mistakes_before_touching_the_model(name, kwargs, error, text):
    args = dict(optimizer_fn=torch.optim.SGD)
    args.update(kwargs)
    with pytest.raises(error) as info:
        strategies.wrap(name, torch.nn.Linear(2, 2), **args)
    assert text in str(info.value)
    if "has no built-in" in text:
        assert "use one of: fsdp_grad_op, fsdp, fsdp2, fairscale_fsdp" in str(info.value)


@pytest.mark.parametrize("name", ["fairscale_oss", "fairscale_sharded", "fairscale_fsdp"])
def test_missing_fairscale_names_the_extra(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "fairscale", None)  # as if it were not installed
    with pytest.raises(ImportError) as info:
        strategies.wrap(name, torch.nn.Linear(2, 2), torch.optim.SGD)
    assert "pip install nbdist[fairscale]" in str(info.value)
    assert "unmaintained upstream" in str(info.value)
