"""The ZeRO estimator, the strategy registry, and ``nbdist mem`` without a group (issue 6)."""
import math

import pytest
import torch

from nbdist import memory, strategies

pytestmark = pytest.mark.timeout(60)

PSI = 20_007_728  # 4 x Linear(2236, 2236)


@pytest.mark.parametrize("stage,name,gb", [(0, "ddp", 120.0), (1, "zero1", 31.4),
                                           (2, "fsdp_grad_op", 16.6), (3, "fsdp", 1.9)])
def test_the_papers_worked_example(stage, name, gb):
    # ZeRO paper, Figure 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12).
    by_stage = memory.estimate(7.5e9, 64, stage, precision="bf16-mixed")
    by_name = memory.estimate("7.5B", 64, name, precision="bf16-mixed")
    assert by_stage.total == by_name.total
    assert round(by_stage.total / 1e9, 1) == gb
    assert memory.human_bytes(by_stage.total) == f"{gb:.1f} GB"
    assert by_name.strategy == name and by_name.stage == stage


def test_mixed_precision_formulas_to_the_byte():
    psi, n = 7_500_000_000, 64
    e = [memory.estimate(psi, n, s, precision="bf16-mixed") for s in range(4)]
    assert [x.total for x in e] == [16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n,
                                    16 * psi // n]
    assert (e[1].params, e[1].grads, e[1].optimizer_state) == (2 * psi, 2 * psi, 12 * psi // n)
    assert "ZeRO-1: 2Ψ + 2Ψ + 12Ψ/N = 4Ψ + 12Ψ/N" in e[1].formula
    assert "ZeRO-2: 2Ψ + 2Ψ/N + 12Ψ/N = 2Ψ + 14Ψ/N" in e[2].formula
    assert "ZeRO-3" in e[3].formula and "= 16Ψ/N" in e[3].formula and "K=12" in e[3].formula
    assert "plain DP" in e[0].formula and "= 16Ψ " in e[0].formula


def test_fp32_formulas_match_the_cpu_measurements_of_facts_section_5():
    mb = {s: memory.estimate(PSI, 2, s).total / 1e6 for s in range(4)}
    assert [round(v, 2) for v in mb.values()] == [320.12, 240.09, 200.08, 160.06]
    e = memory.estimate(PSI, 4, "zero1")
    assert e.total == 8 * PSI + 8 * PSI // 4
    assert "ZeRO-1: 4Ψ + 4Ψ + 8Ψ/N = 8Ψ + 8Ψ/N" in e.formula and "fp32 adam" in e.formula


def test_sharded_parts_round_up_and_other_optimizers():
    e = memory.estimate(10, 4, "fsdp")  # ceil(10 / 4) = 3 parameters per rank
    assert (e.params, e.grads, e.optimizer_state) == (12, 12, 24)
    assert memory.estimate(1000, 2, "ddp", optimizer="sgd").optimizer_state == 0
    assert memory.estimate(1000, 2, "ddp", optimizer="momentum").optimizer_state == 4000
    assert memory.estimate(1000, 2, "zero1", "bf16-mixed", "momentum").optimizer_state == 4000


def test_world_sizes_far_beyond_this_machine_and_models_as_input():
    e = memory.estimate(175e9, 4096, "fsdp2", precision="bf16-mixed")
    assert e.world_size == 4096 and e.total == 16 * math.ceil(175e9 / 4096)
    model = memory.mlp(4, 2236)
    assert memory.count_params(model) == PSI
    assert memory.estimate(model, 2, "ddp").num_params == PSI
    tied = torch.nn.Sequential(torch.nn.Linear(3, 3))
    tied.append(tied[0])
    assert memory.count_params(tied) == 12
    assert memory.parse_count("125M") == 125_000_000 and memory.parse_count(" 1e3 ") == 1000


@pytest.mark.parametrize("kwargs,error,text", [
    (dict(world_size=0), ValueError, "world_size must be a positive int, got 0"),
    (dict(world_size=True), ValueError, "world_size must be a positive int, got True"),
    (dict(strategy="zero9"), ValueError, "'zero9' not found in the strategy registry. Available "
     "names: ddp, zero1"),
    (dict(strategy=4), ValueError, "a ZeRO stage must be 0, 1, 2 or 3, got 4"),
    (dict(precision="fp16"), ValueError, "precision must be one of fp32, bf16-mixed, got 'fp16'"),
    (dict(optimizer="lamb"), ValueError, "optimizer must be one of adam, adamw, momentum, sgd"),
    (dict(model_or_num_params="lots"), ValueError, "expected a positive parameter count such as"),
    (dict(model_or_num_params=0), ValueError, "expected a positive parameter count"),
    (dict(model_or_num_params=True), TypeError, "must be an nn.Module or a parameter count"),
])
def test_estimate_rejects_bad_arguments(kwargs, error, text):
    args = dict(model_or_num_params=1000, world_size=2, strategy="ddp")
    args.update(kwargs)
    with pytest.raises(error) as info:
        memory.estimate(**args)
    assert text in str(info.value)


def test_registry_describes_every_strategy_and_refuses_duplicates():
    names = strategies.available_strategies()
    assert list(names) == ["ddp", "zero1", "fsdp_grad_op", "fsdp", "fsdp2", "fairscale_oss",
                           "fairscale_sharded", "fairscale_fsdp", "deepspeed_zero1",
                           "deepspeed_zero2", "deepspeed_zero3", "tp", "fsdp2+tp", "hsdp",
                           "pp"]
    assert all(desc for desc in names.values())
    assert all("legacy" in names[n] for n in names if n.startswith("fairscale"))
    stages = {n: strategies.get_strategy(n).zero_stage for n in names}
    assert stages == {"ddp": 0, "zero1": 1, "fsdp_grad_op": 2, "fsdp": 3, "fsdp2": 3,
                      "fairscale_oss": 1, "fairscale_sharded": 2, "fairscale_fsdp": 3,
                      "deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3,
                      "tp": 3, "fsdp2+tp": 3, "hsdp": 3, "pp": 0}
    with pytest.raises(ValueError, match="strategy 'ddp' is already registered .*another name, "
                                         "or pass override=True to replace it"):
        strategies.register_strategy("ddp", lambda *a: None, "again", 0)
    original = strategies.get_strategy("ddp")
    try:
        mine = strategies.register_strategy("ddp", lambda *a: None, "mine", 0, override=True)
        assert strategies.get_strategy("ddp") is mine
    finally:
        strategies.registry._REGISTRY["ddp"] = original
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3, got 7"):
        strategies.register_strategy("mine", lambda *a: None, "mine", 7)
    with pytest.raises(ValueError, match=r"'dp' not found in the strategy registry\. Available "
                                         r"names: ddp, zero1, fsdp_grad_op, fsdp, fsdp2, "):
        strategies.get_strategy("dp")
    assert "mine" not in strategies.available_strategies()


def test_model_specs():
    fn = memory.model_spec("mlp:2x64")
    assert memory.count_params(fn()) == 2 * (64 * 64 + 64)
    assert memory.model_spec("7.5B") == 7_500_000_000
    with pytest.raises(ValueError, match=r"--model takes mlp:LAYERSxWIDTH .* got 'cnn:3'"):
        memory.model_spec("cnn:3")
    with pytest.raises(ValueError, match=r"needs at least one layer of width 1 or more .e\.g\. "
                                         r"mlp:4x2236., got 'mlp:0x4'"):
        memory.model_spec("mlp:0x4")


def test_cli_estimate_only_prints_the_papers_table(capsys):
    assert memory.cli(["--model", "7.5B", "--world-size", "64", "--precision", "bf16-mixed",
                       "--strategies", "ddp,zero1,fsdp_grad_op,fsdp"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("optimizer (MiB)  per rank (MiB)")  # one unit, in the header
    for name, mb in [("ddp", " 114441"), ("zero1", " 29951"), ("fsdp_grad_op", " 15870"),
                     ("fsdp ", " 1788")]:
        assert any(line.startswith(name) and line.endswith(mb) for line in out.splitlines())
    assert "zero1: ZeRO-1: 2Ψ + 2Ψ + 12Ψ/N = 4Ψ + 12Ψ/N" in out


def test_cli_estimate_flag_with_an_mlp_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "est.png"
    assert memory.cli(["--model", "mlp:4x2236", "--estimate", "-n", "4", "--plot", str(png)]) == 0
    assert "Ψ=20,007,728, N=4" in capsys.readouterr().out
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv,text", [
    (["--model", "cnn"], "--model takes mlp:LAYERSxWIDTH"),
    (["--model", "1B", "--strategies", "ddp,zero2"], "'zero2' not found in the strategy registry"),
    (["--model", "1B", "--world-size", "0"], "world_size must be a positive int, got 0"),
])
def test_cli_reports_mistakes(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        memory.cli(argv)
    assert info.value.code == 2 and text in capsys.readouterr().err


def test_cli_plot_without_matplotlib(monkeypatch, capsys):
    import sys

    import nbdist.ui.plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "nbdist.ui.plots.memory", raising=False)
    monkeypatch.delattr(nbdist.ui.plots, "memory", raising=False)
    with pytest.raises(SystemExit):
        memory.cli(["--model", "1B", "--plot", "x.png"])
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install nbdist[notebook]" in err


def test_plot_estimate_draws_every_strategy_on_log_axes():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from nbdist.memory import estimate_curve
    from nbdist.ui.plots.memory import plot_estimate

    ax = estimate_curve(7.5e9, ["ddp", "zero1", "fsdp"], precision="bf16-mixed").plot(mark=64)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    ddp = ax.get_lines()[0]
    assert list(ddp.get_xdata()) == [2 ** i for i in range(13)]
    assert ddp.get_ydata()[0] == pytest.approx(120.0)  # GB at N = 1
    assert "GB" in ax.get_ylabel()
    with pytest.raises(ValueError, match="needs at least one strategy name"):
        estimate_curve(1000, [])
    with pytest.raises(TypeError, match="build it with nbdist.memory.estimate_curve"):
        plot_estimate(1000)
    matplotlib.pyplot.close("all")


def test_cli_names_a_value_that_starts_with_a_minus(capsys):
    """argparse took '-1e3' for an option ("expected one argument"); the value is named now."""
    with pytest.raises(SystemExit):
        memory.cli(["--model", "1B", "--estimate", "--world-size", "-1e3"])
    assert "argument --world-size/-n: invalid int value: '-1e3'" in capsys.readouterr().err
