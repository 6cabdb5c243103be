"""The analytic traffic of a layer plan and the record's arithmetic, without ranks (issue 19)."""
import pytest
import torch

from nbdist import parallel
from nbdist.bench import Traffic, expected_traffic
from nbdist.bench.traffic import wire_factor


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 4))


def test_wire_factors_nccl_and_gloo():
    assert wire_factor("all_reduce", 4) == 1.5
    assert wire_factor("reduce_scatter", 4) == 0.75
    assert wire_factor("reduce_scatter", 4, "gloo") == 1.5  # a whole all_reduce on gloo
    assert wire_factor("barrier", 4) is None
    assert wire_factor("all_gather", 1) == 0.0
    assert (wire_factor("send", 2), wire_factor("recv", 2)) == (1.0, 0.0)  # the sender counts it


def test_tp_on_a_linear_stack():
    # fc1 Colwise reads the model's input (no gradient): only fc2's forward all_reduce
    rows = expected_traffic(mlp(), "tp", tokens=8, world_size=2)
    assert rows == [{"dim": "tp", "ranks": 2, "op": "all_reduce", "calls": 1, "bytes": 8 * 8 * 4}]


def test_tp_on_a_block_counts_q_k_v():
    block = torch.nn.Sequential(parallel.TransformerBlock(16, 4, 32))
    (row,) = expected_traffic(block, "tp", tokens=10, world_size=2)
    # forward: o, fc2; backward: q, k, v, fc1 -- each T x 16 floats
    assert (row["calls"], row["bytes"]) == (6, 6 * 10 * 16 * 4)


def test_fsdp2_pads_each_parameter_to_the_shards():
    rows = {(r["dim"], r["op"]): r for r in expected_traffic(
        torch.nn.Linear(3, 5), "hsdp", tokens=4, world_size=4, dp_shard=4)}
    # 4 shards: weight 5x3 -> 2 rows per shard x 4 x 3, bias 5 -> 2 x 4; the root: gathered once
    assert set(rows) == {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")}
    assert rows["dp_shard", "all_gather"]["calls"] == 1
    assert rows["dp_shard", "all_gather"]["bytes"] == (8 * 3 + 8) * 4
    assert rows["dp_shard", "reduce_scatter"]["bytes"] == (8 * 3 + 8) * 4


def test_hsdp_all_reduces_the_shard_across_replicas():
    rows = {(r["dim"], r["op"]): r for r in expected_traffic(mlp(), "hsdp", tokens=4,
                                                             world_size=4)}
    assert rows["dp_replicate", "all_reduce"]["bytes"] * 2 == rows["dp_shard",
                                                                   "reduce_scatter"]["bytes"]
    assert rows["dp_shard", "all_gather"]["calls"] == 6  # 3 Linear groups, forward + backward


def test_summary_and_compare():
    rec = Traffic.merge([
        Traffic([{"rank": r, "dim": "dp", "ranks": 2, "op": "reduce_scatter", "calls": 2,
                  "bytes": 100, "dtype": "float32", "backend": "gloo"}]) for r in (1, 0)])
    (row,) = rec.summary()
    assert (row["calls"], row["bytes"], row["wire_bytes"]) == (2, 100, 100)
    (cmp,) = rec.compare([{"dim": "dp", "op": "reduce_scatter", "calls": 2, "bytes": 95}])
    assert cmp["ratio"] == pytest.approx(100 / 95)
    assert cmp["nccl_wire_bytes"] == 47.5
    assert "measured/algorithmic" in str(rec.compare([]))
    with pytest.raises(TypeError, match="takes Traffic records"):
        Traffic.merge([[]])


def blocks(n):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[parallel.TransformerBlock(16, 4, 32) for _ in range(n)],
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def test_pipeline_one_send_each_way_per_microbatch_and_boundary():
    # 4 ranks, one stage each (split after blocks 0, 1, 2); T = 64 tokens in m = 4 microbatches:
    # each send is 16 tokens x 16 features x 4 bytes
    size = 64 // 4 * 16 * 4
    ends = expected_traffic(blocks(4), "pp", tokens=64, world_size=4, split=[1, 2, 3], rank=0)
    middle = expected_traffic(blocks(4), "pp", tokens=64, world_size=4, split=[1, 2, 3], rank=1)
    mean = expected_traffic(blocks(4), "pp", tokens=64, world_size=4, split=[1, 2, 3])
    rows = {r["op"]: r for r in ends}
    assert (rows["send"]["calls"], rows["send"]["bytes"]) == (4, 4 * size)  # activations out
    assert (rows["recv"]["calls"], rows["recv"]["bytes"]) == (4, 4 * size)  # their gradients in
    assert (rows["all_reduce"]["calls"], rows["all_reduce"]["bytes"]) == (1, 8)  # the check
    assert {r["op"]: r["calls"] for r in middle} == {"all_reduce": 1, "send": 8, "recv": 8}
    assert {r["op"]: r["calls"] for r in mean} == {"all_reduce": 1, "send": 6, "recv": 6}
    assert {r["dim"] for r in mean} == {"pp"} and {r["ranks"] for r in mean} == {4}
    # the schedule changes the order, not the count; interleaved: 2 stages per rank
    assert expected_traffic(blocks(4), "pp", tokens=64, world_size=4, schedule="gpipe",
                            split=[1, 2, 3]) == mean
    inter = expected_traffic(blocks(6), "pp", tokens=64, world_size=4, schedule="interleaved1f1b")
    assert {r["op"]: r["calls"] for r in inter} == {"all_reduce": 1, "send": 14, "recv": 14}
    assert expected_traffic(blocks(2), "pp", tokens=8, world_size=1) == []


def test_pipeline_widths_from_the_layers_or_given():
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    # 2 ranks, split after the ReLU: the stage ends in ReLU, whose width is its Linear's (32)
    (_, recv, send) = expected_traffic(model, "pp", tokens=8, world_size=2, split=[2],
                                       microbatches=2)
    assert send["bytes"] == 2 * (8 // 2) * 32 * 4 and recv["bytes"] == send["bytes"]
    stages = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.nn.Identity()]
    (_, _, send) = expected_traffic(stages, "pp", tokens=8, world_size=2, microbatches=2)
    assert send["bytes"] == 2 * 4 * 8 * 4
    (_, _, send) = expected_traffic([torch.nn.Tanh(), torch.nn.Tanh()], "pp", tokens=8,
                                    world_size=2, microbatches=2, widths=[5])
    assert send["bytes"] == 2 * 4 * 5 * 4


def test_pipeline_figure_errors():
    with pytest.raises(ValueError, match="cannot tell the width of what stage 0 .layers from 0. "
                                         "sends.*pass widths="):
        expected_traffic([torch.nn.Tanh(), torch.nn.Tanh()], "pp", tokens=8, world_size=2)
    with pytest.raises(ValueError, match="widths= lists the features per token each stage but "
                                         "the last sends: 1 ints for 2 stages, got 2"):
        expected_traffic(blocks(1), "pp", tokens=8, world_size=2, widths=[16, 16])
    with pytest.raises(ValueError, match=r"rank=2 is outside 0\.\.1"):
        expected_traffic(blocks(1), "pp", tokens=8, world_size=2, rank=2)
    with pytest.raises(ValueError, match="split=.* is not valid"):  # the pipeline's own checks
        expected_traffic(blocks(1), "pp", tokens=8, world_size=2, split=[5])
