"""The estimator's tp=, pp= and activations (Korthikanti et al. 2022), and the mesh formulas (issue 19)."""
import pytest

from nbdist import memory
from nbdist.memory import Transformer
from nbdist.memory.activations import per_layer

pytestmark = pytest.mark.timeout(60)

# A small config, by hand: s=8, b=2, h=16, a=4 -> sbh = 256, 5as/h = 10.
SMALL = Transformer(layers=4, hidden=16, heads=4, seq_len=8, micro_batch=2)


def test_activation_formulas_by_hand():
    assert per_layer(SMALL) == 256 * (34 + 10)                      # no parallelism: 11,264 B
    assert per_layer(SMALL, tp=2) == 256 * (10 + 12 + 5)            # sbh(10 + 24/t + 5as/(ht))
    assert per_layer(SMALL, tp=2, sequence_parallel=True) == 256 * (17 + 5)   # sbh(34/t + ...)
    assert per_layer(SMALL, tp=2, recompute="selective") == 256 * 22
    assert per_layer(SMALL, tp=4, sequence_parallel=True, recompute="selective") == 256 * 34 / 4
    assert per_layer(SMALL, tp=4, recompute="full") == 2 * 256


def test_pipeline_holds_its_layers_times_the_microbatches_in_flight():
    one = 256 * 22  # tp=2, SP: bytes per layer
    e = memory.estimate(1000, 8, "ddp", tp=2, pp=2, transformer=SMALL, sequence_parallel=True)
    assert e.activations == one * 2 * 2  # L/pp = 2 layers x pp = 2 microbatches (1F1B)
    assert (e.tp, e.pp, e.dp) == (2, 2, 2)
    e = memory.estimate(1000, 8, "ddp", tp=2, pp=2, transformer=SMALL, sequence_parallel=True,
                        microbatches=1)
    assert e.activations == one * 2
    e = memory.estimate(1000, 8, "ddp", tp=2, pp=2, transformer=SMALL, sequence_parallel=True,
                        microbatches=8, schedule="gpipe")
    assert e.activations == one * 2 * 8
    e = memory.estimate(1000, 2, "tp", transformer=SMALL, sequence_parallel=True)
    assert e.activations == one * 4 and e.tp == 2  # "tp": the whole world, no pipeline
    for text in ("Korthikanti et al. 2022", "16-bit activations", "sbh(34/t + 5as/(ht))",
                 "5,632 B per layer", "x 4 layers per stage", "1 microbatch in flight"):
        assert text in e.assumptions
    assert "Korthikanti" in repr(e)


def test_model_state_of_the_model_parallel_share():
    psi, n = 8_000_000, 16
    e = memory.estimate(psi, n, "zero1", tp=2, pp=2, replicated=1_000_000)
    local = (7_000_000 // 2 + 1_000_000) // 2  # ((Ψ - Ψ_r)/tp + Ψ_r)/pp = 2,250,000
    assert (e.params, e.grads, e.optimizer_state) == (4 * local, 4 * local, 8 * local // 4)
    assert "tp=2, pp=2), then over dp=4: ZeRO-1" in e.formula and "Ψ_r=1,000,000" in e.formula
    # tp=pp=1 is the ZeRO formula itself; fsdp2+tp over tp x dp = N is ZeRO-3 over N
    assert memory.estimate(psi, n, "zero1", tp=1, pp=1) == memory.estimate(psi, n, "zero1")
    assert memory.estimate(psi, n, "fsdp2+tp", tp=4).total == memory.estimate(psi, n, 3).total
    assert memory.estimate(psi, 4, "pp", tp=2).total == 16 * psi // 4  # pp = 4 / tp = 2
    table = str(memory.estimate_table(psi, n, ["ddp", "fsdp"], tp=2, pp=2, transformer=SMALL))
    assert "tp=2, pp=2, dp=4" in table and "activations" in table and "Korthikanti" in table
    curve = memory.estimate_curve(psi, ["ddp"], world_sizes=[4, 8], tp=2, pp=2)
    assert curve.totals["ddp"] == [16 * (psi // 4)] * 2


@pytest.mark.parametrize("kwargs,text", [
    (dict(world_size=8, tp=3), "tp x pp = 3 x 1 = 3 does not divide world_size=8"),
    (dict(world_size=8, tp=2, pp=3), "Some that fit 8 ranks (tp, dp, pp): (1, 8, 1)"),
    (dict(world_size=8, tp=0), "tp must be a positive int, got 0"),
    (dict(world_size=8, tp=8, transformer=SMALL), "tp=8 does not divide the 4 attention heads"),
    (dict(world_size=8, tp=1, pp=8, transformer=SMALL),
     "pp=8 does not divide the 4 layers into equal stages"),
    (dict(world_size=8, tp=4, transformer=Transformer(4, 16, 4, 6), sequence_parallel=True),
     "tp does not divide seq_len=6"),
    (dict(world_size=8, pp=2, transformer=SMALL, schedule="gpipe"), "pass microbatches="),
    (dict(world_size=8, transformer=SMALL, schedule="zb"), "schedule must be one of 1f1b, gpipe"),
    (dict(world_size=8, transformer=SMALL, recompute="some"), "recompute must be None"),
    (dict(world_size=8, tp=2, replicated=-1), "replicated must be a parameter count"),
    (dict(world_size=8, transformer=(4, 16, 4, 8)), "transformer must be an nbdist.memory"),
])
def test_bad_tp_and_pp_are_explained(kwargs, text):
    with pytest.raises((ValueError, TypeError), match=None) as err:
        memory.estimate(1000, kwargs.pop("world_size"), "ddp", **kwargs)
    assert text in str(err.value)


def test_transformer_shape_is_checked():
    with pytest.raises(ValueError, match="hidden=10 must be a multiple of heads=4"):
        Transformer(2, 10, 4, 8)
    with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
        Transformer(2, 16, 4, 0)


def test_mesh_formulas_from_the_split():
    split = {"sharded": {"numel": 6368}, "replicated": {"numel": 192}, "tp": 2, "dp": 2}
    e = memory.mesh_estimate("fsdp2+tp", split, 4)
    assert e.total == 16 * (6368 // 4 + 192 // 2)
    assert e.formula.startswith("2-D: (P + G + K)(Ψ_s/(dp·tp) + Ψ_r/dp)")
    assert memory.mesh_estimate("tp", dict(split, dp=1), 2).total == 16 * (6368 // 2 + 192)
    assert memory.mesh_estimate("hsdp", dict(split, tp=1), 4).total == 16 * (6560 // 2)
    with pytest.raises(ValueError, match="mesh_estimate\\(\\) knows tp, fsdp2\\+tp, hsdp"):
        memory.mesh_estimate("ddp", split, 2)


def test_cli_estimates_with_tp_pp_and_activations(capsys):
    assert memory.cli(["--model", "7.5B", "-n", "64", "--strategies", "ddp,fsdp", "--tp", "8",
                       "--pp", "2", "--transformer", "L=32,h=4096,a=32,s=2048",
                       "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3, tp=8, pp=2, dp=4" in out and "activations (GiB)" in out
    assert "119,537,664 B per layer" in out and "x 2 microbatches in flight (1f1b" in out


@pytest.mark.parametrize("argv,text", [
    (["--model", "7.5B", "-n", "64", "--tp", "3"], "tp x pp = 3 x 1 = 3 does not divide"),
    (["--model", "7.5B", "-n", "8", "--tp", "4", "--transformer", "L=2,h=12,a=6,s=8"],
     "tp=4 does not divide the 6 attention heads"),
    (["--model", "7.5B", "--transformer", "L=2,h=12"], "lacks a, s"),
    (["--model", "7.5B", "--transformer", "layers=2"], "--transformer takes L=LAYERS"),
    (["--model", "mlp:2x8", "--tp", "2"], "apply to the estimate: give a parameter count"),
])
def test_cli_explains_bad_tp_and_pp(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        memory.cli(argv)
    assert info.value.code == 2 and text in capsys.readouterr().err


def test_hsdp_shards_over_dp_shard_not_the_world():
    from nbdist import memory

    hsdp, zero3_half = memory.estimate(8_000_000, 4, "hsdp"), memory.estimate(8_000_000, 2, "fsdp")
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (zero3_half.params, zero3_half.grads,
                                                         zero3_half.optimizer)
    assert "(HSDP: N = dp_shard = 2 of 4 ranks)" in hsdp.formula
