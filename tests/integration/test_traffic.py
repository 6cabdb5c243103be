"""What each mesh dimension sends, measured on real gloo ranks against the layer plan (issue 19).

2 ranks: ``tp`` on a Linear stack and a transformer, the errors. 4 ranks (one group for the
module): ``fsdp2+tp`` and ``hsdp`` on 2 x 2 meshes. Measured calls per dimension equal the
analytic ones; bytes (nccl-tests' size, the algorithmic figure) agree within 10% -- in practice
exactly, FSDP2's padding included. gloo's reduce_scatter is issued as a reduce_scatter (so the
count and size compare like for like) but runs as a whole all_reduce: ``wire_bytes`` shows that.
"""
import sys

import cloudpickle
import pytest
import torch

import nbdist
from nbdist import RemoteError, bench, parallel, strategies

pytestmark = pytest.mark.timeout(150)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file

MESH = {"tp": lambda w, o: {"tp": w},
        "fsdp2+tp": lambda w, o: {"dp": -1, "tp": o.get("tp", 2)},
        "hsdp": lambda w, o: {"dp_replicate": -1, "dp_shard": o.get("dp_shard", w // 2)}}


def make_model(kind):
    torch.manual_seed(0)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
                                   torch.nn.ReLU(), torch.nn.Linear(8, 4))
    return torch.nn.Sequential(parallel.TransformerBlock(16, 4, 32),
                               parallel.TransformerBlock(16, 4, 32), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def measure(name, kind="block", steps=2, **options):
    """One warm-up step, then ``steps`` measured; return (measured, expected)."""
    import functools

    import torch.distributed as dist

    world = dist.get_world_size()
    model = make_model(kind)
    shape = (2, 8, 16) if kind == "block" else (8, 16)
    tokens = shape[0] * (shape[1] if kind == "block" else 1)
    expected = bench.expected_traffic(model, name, tokens=tokens, world_size=world, **options)
    wrapped, opt = strategies.wrap(name, model, functools.partial(torch.optim.SGD, lr=0.01),
                                   **options)
    mesh = parallel.device_mesh(**MESH[name](world, options))
    x = torch.randn(*shape)

    def step():
        wrapped(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    with bench.traffic(mesh, steps=steps) as tr:
        for _ in range(steps):
            step()
    return tr, expected


def measure_pipeline(schedule, steps=2):
    """A pipeline of the block model (widened to 4 layers for interleaved), one warm-up step,
    then ``steps`` measured under traffic(device_mesh(pp=world)); return (measured, expected)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    torch.manual_seed(0)
    blocks = 3 if schedule == "interleaved1f1b" else 2
    model = torch.nn.Sequential(*[parallel.TransformerBlock(16, 4, 32) for _ in range(blocks)],
                                torch.nn.Linear(16, 4))
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)
    options = dict(schedule=schedule, microbatches=4)
    expected = bench.expected_traffic(model, "pp", tokens=4 * 8, world_size=world, **options)
    pipe = parallel.pipeline(model, loss_fn=torch.nn.functional.mse_loss, **options)
    pipe.step(x, y)  # the first step infers the shapes the stages exchange
    with bench.traffic(parallel.device_mesh(pp=world), steps=steps) as tr:
        for _ in range(steps):
            pipe.step(x, y)
    return tr, expected


def check(results):
    measured = bench.Traffic.merge(tr for tr, _ in results)
    expected = results[0][1]
    table = measured.compare(expected)
    assert len(table) == len(expected), table
    for row in table:
        assert row["calls"] == row["expected_calls"], table
        assert row["ratio"] == pytest.approx(1.0, rel=0.10), table
    return measured, table


@pytest.fixture(scope="module")
def two():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        yield g


class TestTwoRanks:
    @pytest.mark.parametrize("kind", ["mlp", "block"])
    def test_tp_sends_what_the_plan_says(self, two, kind):
        measured, table = check(two.run(measure, "tp", kind))
        assert {r["dim"] for r in table} == {"tp"}
        assert {r["op"] for r in table} == {"all_reduce"}
        assert len({r["rank"] for r in measured}) == 2
        assert "calls/step" in str(measured) and "measured/algorithmic" in str(table)

    def test_tp_with_sequence_parallel_sends_what_the_plan_says(self, two):
        """Per block: 6 all_gathers (5 for the first: the model's input needs no gradient) and
        4 reduce_scatters of T x h, and no all_reduce."""
        measured, table = check(two.run(measure, "tp", "block", sequence_parallel=True))
        rows = {r["op"]: r for r in table}
        assert set(rows) == {"all_gather", "reduce_scatter"}
        assert (rows["all_gather"]["calls"], rows["reduce_scatter"]["calls"]) == (11, 8)

    @pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
    def test_a_pipeline_sends_what_its_stages_say(self, two, schedule):
        """Per microbatch and stage boundary: one activation send forward, one gradient send
        backward (a recv on the other rank), T/m x width; plus the step's 8-byte batch check."""
        measured, table = check(two.run(measure_pipeline, schedule))
        assert {(r["dim"], r["op"]) for r in table} == {
            ("pp", "send"), ("pp", "recv"), ("pp", "all_reduce")}
        assert len({r["rank"] for r in measured}) == 2
        sends = {r["rank"]: r["calls"] for r in measured if r["op"] == "send"}
        # 1f1b: one boundary, 4 microbatches, each rank sends 4; interleaved: 3 boundaries
        assert sends == ({0: 4, 1: 4} if schedule == "1f1b" else {0: 12, 1: 12})

    def test_a_mesh_of_another_size_is_refused(self, two):
        def run():
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh

            with bench.traffic(DeviceMesh("cpu", [dist.get_rank()], mesh_dim_names=("tp",))):
                pass
        with pytest.raises(RemoteError, match="covers 1 ranks but this group has 2"):
            two.run(run)
        assert two.run(lambda: 1) == [1, 1]

    def test_bad_arguments(self, two):
        with pytest.raises(RemoteError, match="takes a DeviceMesh with named dimensions"):
            two.run(lambda: bench.traffic(mesh=object()).__enter__())
        with pytest.raises(RemoteError, match="steps must be a positive int"):
            two.run(lambda: bench.traffic(steps=0).__enter__())


def test_outside_the_ranks_and_unknown_strategies():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        bench.traffic().__enter__()
    with pytest.raises(ValueError, match="knows the strategies tp, fsdp2"):
        bench.expected_traffic(make_model("mlp"), "ddp", tokens=8, world_size=2)


@pytest.fixture(scope="module")
def four(two):
    two.stop()  # one group at a time on a small machine
    with nbdist.start(4, backend="gloo", device="cpu", timeout=90) as g:
        yield g


class TestMesh:
    def test_fsdp2_tp_on_a_2x2_mesh(self, four):
        measured, table = check(four.run(measure, "fsdp2+tp", "block", tp=2))
        ops = {(r["dim"], r["op"]) for r in table}
        assert ops == {("tp", "all_reduce"), ("dp", "all_gather"), ("dp", "reduce_scatter")}
        summary = {(r["dim"], r["op"]): r for r in measured.summary()}
        rs = summary["dp", "reduce_scatter"]
        assert rs["wire_bytes"] == pytest.approx(rs["bytes"])  # gloo: a whole all_reduce, 2(n-1)/n
        nccl = {(r["dim"], r["op"]): r for r in table}["dp", "reduce_scatter"]["nccl_wire_bytes"]
        assert rs["wire_bytes"] == pytest.approx(2 * nccl, rel=0.10)

    def test_fsdp2_tp_with_sequence_parallel(self, four):
        measured, table = check(four.run(measure, "fsdp2+tp", "block", tp=2,
                                         sequence_parallel=True))
        assert {(r["dim"], r["op"]) for r in table} == {
            ("tp", "all_gather"), ("tp", "reduce_scatter"), ("tp", "all_reduce"),
            ("dp", "all_gather"), ("dp", "reduce_scatter")}  # all_reduce: the norms' grads

    def test_hsdp_on_a_2x2_mesh(self, four):
        measured, table = check(four.run(measure, "hsdp", "block"))
        assert {(r["dim"], r["op"]) for r in table} == {
            ("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"),
            ("dp_replicate", "all_reduce")}
