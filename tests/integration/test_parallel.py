"""Meshes and the mesh strategies on real gloo ranks agree with one process (issue 19).

Each training test compares every parameter's whole gradient at every step with one process on
the whole batch (1e-5), then the losses and the final weights. 2 ranks: ``tp`` on a Linear stack
and on transformer blocks (with and without sequence parallel), ``fsdp2+tp`` (dp 1 x tp 2) and
``hsdp`` (2 x 1 and 1 x 2), a plan of one's own, the errors (and the group still usable after
each). 4 ranks (one group for the class): the mesh picture against torch's process groups, ``tp``
over 4, ``fsdp2+tp`` (with SP) and ``hsdp`` on 2 x 2 meshes. Training uses SGD with momentum (foreach): Adam's update divides by the square
root of the gradient, which turns float noise in a gradient that is zero in exact arithmetic (a
key bias under softmax) into a full step, so Adam-trained weights drift apart by ~lr.
"""
import sys

import cloudpickle
import pytest
import torch

import nbdist
from nbdist import RemoteError, parallel, strategies

pytestmark = pytest.mark.timeout(150)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file


def make_model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
                                   torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return torch.nn.Sequential(parallel.TransformerBlock(16, 4, 32),
                               parallel.TransformerBlock(16, 4, 32), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def train(name, kind="mlp", steps=3, **options):
    """``steps`` SGD steps with strategy ``name`` and with the same model in this process on the
    whole batch; this rank's batch is its data-parallel index's share."""
    import copy
    import functools

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = make_model(kind)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    shape = (4, 16) if kind == "mlp" else (4, 8, 16)
    x, y = torch.randn(*shape, generator=gen), torch.randn(*shape[:-1], 4, generator=gen)
    rank, world = dist.get_rank(), dist.get_world_size()
    if name == "tp":
        dp, index = 1, 0  # every rank sees the whole batch
    elif name == "fsdp2+tp":
        layout = parallel.MeshLayout(world, dp=-1, tp=options.get("tp", 2))
        dp, index = layout.sizes["dp"], layout.coords(rank)["dp"]
    else:
        dp, index = world, rank
    xs, ys = x.chunk(dp)[index], y.chunk(dp)[index]
    make_opt = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, foreach=True)
    wrapped, opt = strategies.wrap(name, model, make_opt, **options)
    ref_opt = make_opt(reference.parameters())
    losses, ref_losses, grad_errors = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(wrapped(xs), ys)
        loss.backward()
        grads = full_gradients(wrapped)  # before the step; FSDP/HSDP averaged them over dp
        opt.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_losses.append(ref_loss.item())
        ref_grads = {k: p.grad for k, p in reference.named_parameters()}
        assert sorted(grads) == sorted(ref_grads), (sorted(grads), sorted(ref_grads))
        grad_errors.append(max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads))
    full = strategies.full_parameters(wrapped)
    expected = dict(reference.named_parameters())
    local = [p.to_local() if isinstance(p, DTensor) else p for p in wrapped.parameters()]
    return dict(losses=losses, ref_losses=ref_losses, dp=dp, names=sorted(full),
                grad_errors=grad_errors, grad_size=max(p.grad.abs().max().item()
                                                       for p in reference.parameters()),
                expected_names=sorted(expected),
                error=max((full[k] - expected[k]).abs().max().item() for k in expected),
                local_numel=sum(p.numel() for p in local),
                total=sum(p.numel() for p in expected.values()))


def full_gradients(model):
    """Every parameter's whole gradient by name (a collective for DTensor ones: all ranks call
    it). A gradient sharded over ``dp`` was already averaged over it by FSDP2's reduce-scatter
    (and over ``dp_replicate`` by HSDP's all-reduce), so it is the whole batch's gradient."""
    from torch.distributed.tensor import DTensor

    return {k: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for k, p in model.named_parameters()}


def check(out, shards):
    """Same gradients at every step and same weights as one process; the mean of the dp ranks'
    losses is the full-batch loss."""
    world = len(out)
    for rank in out:
        assert max(rank["grad_errors"]) < 1e-5, rank["grad_errors"]
        assert rank["grad_size"] > 1e-3  # ... and the gradients are not all tiny
        assert rank["names"] == rank["expected_names"]
        assert rank["error"] < 1e-5, rank["error"]
        assert rank["losses"][-1] < rank["losses"][0]
    for step, ref in enumerate(out[0]["ref_losses"]):
        mean = sum(r["losses"][step] for r in out) / world  # tp ranks repeat their dp rank's loss
        assert mean == pytest.approx(ref, abs=1e-5)
    # sharded layers hold 1/shards of their weights on each rank
    assert all(r["local_numel"] < r["total"] / shards * 1.5 for r in out), [
        (r["local_numel"], r["total"]) for r in out]


def still_usable(group):
    t = group.run(lambda: (lambda t: (torch.distributed.all_reduce(t), t.item())[1])(
        torch.ones(1)))
    assert t == [float(group.world_size)] * group.world_size


@pytest.fixture(scope="class")
def two():
    """2 ranks for the TestTwoRanks tests, stopped before the 4-rank group starts."""
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        yield g


@pytest.fixture(scope="class")
def four():
    """4 ranks (2 x 2 meshes) for the TestMesh tests."""
    with nbdist.start(4, backend="gloo", device="cpu", timeout=90) as g:
        yield g


class TestTwoRanks:
    @pytest.fixture
    def group(self, two):
        return two

    @pytest.mark.parametrize("kind,options", [("mlp", {}), ("block", {}),
                                              ("block", {"sequence_parallel": True})])
    def test_tp_trains_like_one_process(self, group, kind, options):
        check(group.run(train, "tp", kind, **options), shards=1.1)

    @pytest.mark.parametrize("name,kind,options,shards", [
        ("fsdp2+tp", "mlp", {"tp": 2}, 1.1),  # dp 1 x tp 2
        ("fsdp2+tp", "block", {"sequence_parallel": True}, 1.1),  # the default tp=2
        ("hsdp", "mlp", {}, 1),  # the default: dp_replicate 2 x dp_shard 1, nothing sharded
        ("hsdp", "block", {"dp_shard": 2}, 2)])  # dp_replicate 1 x dp_shard 2
    def test_2d_strategies_on_a_degenerate_mesh_train_like_one_process(self, group, name, kind,
                                                                       options, shards):
        check(group.run(train, name, kind, **options), shards=shards)

    def test_tp_with_a_plan_of_ones_own(self, group):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {"2": ColwiseParallel(), "4": RowwiseParallel()}  # the first layer replicated
        out = group.run(train, "tp", "mlp", plan=plan)
        check(out, shards=1)
        assert out[0]["local_numel"] > out[0]["total"] / 2

    @pytest.mark.parametrize("call,text", [
        (lambda: parallel.device_mesh(tp=3), "mesh sizes tp=3 do not fit 2 ranks: the sizes must "
         "multiply to the world size (their product is 3). Valid for 2 ranks over dp, tp: dp=2; "
         "tp=2"),
        (lambda: strategies.wrap("tp", torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(),
                                                           torch.nn.Linear(5, 2)),
                                 torch.optim.SGD), "tp=2 does not divide layer '0' "
         "(Linear(in_features=4, out_features=5, bias=True)): ColwiseParallel splits its 5 output "
         "features over 2 ranks"),
        (lambda: strategies.wrap("tp", make_model("mlp"), torch.optim.SGD, tp=2),
         "strategy 'tp' has no option 'tp'; its options are: plan, sequence_parallel"),
        (lambda: strategies.wrap("tp", torch.nn.Conv1d(2, 2, 1), torch.optim.SGD),
         "auto_plan found nothing to shard in Conv1d"),
    ])
    def test_mistakes_raise_on_every_rank_and_leave_the_group_usable(self, group, call, text):
        with pytest.raises(RemoteError) as info:
            group.run(call)
        assert text in str(info.value)
        still_usable(group)

    def test_memory_measure_knows_tp(self, group):
        import functools

        report = nbdist.memory.measure(group, functools.partial(make_model, "mlp"), ["tp"],
                                       steps=1, batch=2)
        rows = list(report)
        assert [r.strategy for r in rows] == ["tp", "tp"]
        assert all(0 < r.params < 4 * r.num_params for r in rows)  # bytes of this rank's shards


class TestMesh:
    @pytest.fixture
    def group(self, four):
        return four

    @pytest.mark.parametrize("sizes", [dict(dp=2, tp=2), dict(dp_replicate=2, dp_shard=2),
                                       dict(tp=4), dict(pp=2, dp=-1)])
    def test_the_picture_has_the_groups_torch_made(self, group, sizes):
        def groups(sizes):
            mesh = parallel.device_mesh(**sizes)
            assert parallel.device_mesh(**sizes) is mesh  # made once per group
            return mesh.mesh_dim_names, parallel.mesh_ranks(mesh)

        layout = parallel.MeshLayout(4, **sizes)
        for rank, (names, ranks) in enumerate(group.run(groups, sizes)):
            assert names == layout.names
            for dim in layout.names:
                assert ranks[dim] == next(g for g in layout.groups(dim) if rank in g)

    @pytest.mark.parametrize("name,kind,options", [
        ("fsdp2+tp", "mlp", {"tp": 2}), ("fsdp2+tp", "block", {"sequence_parallel": True}),
        ("hsdp", "mlp", {}), ("hsdp", "block", {"dp_shard": 2})])
    def test_2d_strategies_train_like_one_process(self, group, name, kind, options):
        check(group.run(train, name, kind, **options), shards=2)

    @pytest.mark.parametrize("kind,options", [("mlp", {}), ("block", {}),
                                              ("block", {"sequence_parallel": True})])
    def test_tp_on_four_ranks_trains_like_one_process(self, group, kind, options):
        check(group.run(train, "tp", kind, **options), shards=1.5)

    @pytest.mark.parametrize("name,options,text", [
        ("fsdp2+tp", {"tp": 3}, "strategy 'fsdp2+tp': tp=3 does not divide the 4 ranks; valid tp "
         "sizes for 4 ranks: 1, 2, 4"),
        ("hsdp", {"dp_shard": 3}, "strategy 'hsdp': dp_shard=3 does not divide the 4 ranks"),
        ("hsdp", {"tp": 2}, "strategy 'hsdp' has no option 'tp'; its options are: dp_shard, "
         "reshard_after_forward, mp_policy, offload_policy"),
    ])
    def test_bad_sizes_and_options(self, group, name, options, text):
        with pytest.raises(RemoteError) as info:
            group.run(lambda: strategies.wrap(name, make_model("mlp"), torch.optim.SGD,
                                              **options))
        assert text in str(info.value)
        still_usable(group)
