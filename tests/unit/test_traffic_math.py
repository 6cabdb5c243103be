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
