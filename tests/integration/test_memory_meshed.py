"""What each rank holds under tp (2 ranks) and fsdp2+tp (2 x 2 mesh), to the byte (issue 19)."""
import sys

import cloudpickle
import pytest
import torch

import nbdist
from nbdist import memory
from nbdist.parallel.models import TransformerBlock

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file

DIM, HEADS, SEQ = 16, 2, 8
# per block: q, k, v, o and fc1 (16 -> 64), fc2 (64 -> 16); two LayerNorms of 16
BLOCK = 4 * (DIM * DIM + DIM) + (DIM * 4 * DIM + 4 * DIM) + (4 * DIM * DIM + DIM) + 4 * DIM
# the plan splits q, k, v, fc1 (weights and biases: Colwise) and o, fc2 weights (Rowwise);
# norms and the Rowwise biases of o and fc2 stay whole on every tp rank
REPLICATED = 2 * (4 * DIM + 2 * DIM)  # two blocks: 192
SHARDED = 2 * BLOCK - REPLICATED  # 6,368
STEPS = 4 * 2 * 16  # Adam's float32 step counter for each of the 32 parameter tensors


def two_blocks():
    return torch.nn.Sequential(TransformerBlock(DIM, HEADS), TransformerBlock(DIM, HEADS))


def tokens(batch):
    return torch.randn(batch, SEQ, DIM)


@pytest.fixture(scope="module")
def group4():
    g = nbdist.start(4, backend="gloo", device="cpu", timeout=60)
    yield g
    g.stop()


def check(rec, local_params, sharded, replicated):
    assert (rec.params, rec.grads) == (4 * local_params, 4 * local_params)
    assert rec.optimizer == 8 * local_params + STEPS  # exp_avg + exp_avg_sq, and the counters
    assert rec.estimate == 16 * local_params  # the formula, to the byte
    assert rec.model_state - rec.estimate == STEPS
    assert (rec.sharded, rec.replicated) == (16 * sharded, 16 * replicated)
    assert rec.split["sharded"]["numel"] == SHARDED
    assert rec.split["replicated"]["numel"] == REPLICATED
    assert any(f"differs from the formula by +{STEPS} B: {STEPS} B of Adam step counters" in n
               for n in rec.notes)


def test_tp_on_two_ranks_to_the_byte(shared_group):
    rep = memory.measure(shared_group, two_blocks, ["tp"], batch=2, input_fn=tokens)
    assert [r.rank for r in rep] == [0, 1]
    for r in rep:  # TP: Ψ_s/tp + Ψ_r
        check(r, SHARDED // 2 + REPLICATED, SHARDED // 2, REPLICATED)
        assert r.formula.startswith("TP: (P + G + K)(Ψ_s/tp + Ψ_r) (Megatron-LM")
        assert (r.split["tp"], r.split["dp"]) == (2, 1)
    table = rep.table()
    assert "sharded (KiB)" in table and "replicated (KiB)" in table
    assert "tp: Ψ_s=6,368 sharded (20 tensors)" in table  # both ranks' note, once
    # the ZeRO-3 over the world would miss half the replicated bytes
    assert memory.estimate(2 * BLOCK, 2, "tp").total < rep[0].estimate


def test_fsdp2_tp_on_a_2x2_mesh_to_the_byte(group4):
    rep = memory.measure(group4, two_blocks, ["fsdp2+tp", "hsdp"], batch=2, input_fn=tokens,
                         options={"fsdp2+tp": {"tp": 2}, "hsdp": {"dp_shard": 2}})
    meshed = [r for r in rep if r.strategy == "fsdp2+tp"]
    assert [r.rank for r in meshed] == [0, 1, 2, 3]
    for r in meshed:  # 2-D: Ψ_s/(dp·tp) + Ψ_r/dp (FSDP2 shards the norms over dp too)
        check(r, SHARDED // 4 + REPLICATED // 2, SHARDED // 4, REPLICATED // 2)
        assert r.formula.startswith("2-D: (P + G + K)(Ψ_s/(dp·tp) + Ψ_r/dp)")
        assert (r.split["tp"], r.split["dp"]) == (2, 2)
    for r in (r for r in rep if r.strategy == "hsdp"):  # HSDP: Ψ/dp_shard, all of it sharded
        assert r.estimate == 16 * (2 * BLOCK // 2) and r.model_state - r.estimate == STEPS
        assert (r.sharded, r.replicated) == (16 * BLOCK, 0)
        assert r.formula.startswith("HSDP: (P + G + K)Ψ/dp_shard")
