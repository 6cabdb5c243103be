"""%dist_mem (and %dist_bench) through a real IPython shell and real ranks."""
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(180)


def test_dist_mem_measures_on_the_current_group(shell, dist_group):
    with capture_output() as cap:
        shell.run_line_magic("dist_mem", "--model mlp:2x64 --strategies ddp,zero1 --steps 1 --batch 4")
    table = cap.outputs[0].data
    assert "ddp" in table["text/plain"] and "zero1" in table["text/plain"]
    assert "<th style='text-align:right'>params (KiB)</th>" in table["text/html"]
    assert any("image/png" in o.data for o in cap.outputs)


def test_dist_mem_puts_deepspeed_next_to_torchs_zero(shell, dist_group):
    pytest.importorskip("deepspeed")
    with capture_output() as cap:
        shell.run_line_magic("dist_mem", "--model mlp:2x64 --strategies zero1,deepspeed_zero1 "
                                         "--steps 1 --batch 4")
    text, html = cap.outputs[0].data["text/plain"], cap.outputs[0].data["text/html"]
    rows = [line.split()[:2] for line in text.splitlines() if line.split()[:1] in
            (["zero1"], ["deepspeed_zero1"]) and line.split()[1][:1].isdigit()]  # not the notes
    # ranks with equal figures share a row ("0-1"): each rank once per strategy
    names = [r[0] for r in rows]  # each strategy in one folded row or one row per rank
    assert names == sorted(names, key=["zero1", "deepspeed_zero1"].index)
    assert all(names.count(n) in (1, 2) for n in ("zero1", "deepspeed_zero1")), names
    assert all(r[1] in ("0-1", "0", "1") for r in rows), rows
    notes = [line for line in text.splitlines() if "DeepSpeed keeps an fp32 master copy" in line]
    assert len(notes) == 1 and notes[0].startswith("deepspeed_zero1"), notes  # once, for both ranks
    assert "DeepSpeed keeps an fp32 master copy" in html
    assert any("image/png" in o.data for o in cap.outputs)


def test_dist_mem_with_a_parameter_count_only_estimates(shell, no_group):
    with capture_output() as cap:
        shell.run_line_magic("dist_mem", "--model 7.5B --strategies ddp,fsdp --world-sizes 64")
    table = cap.outputs[0].data
    assert "per rank (MiB)" in table["text/html"] and "per rank (MiB)" in table["text/plain"]
    assert ">114441</td>" in table["text/html"] and ">1788</td>" in table["text/html"]
    assert any("image/png" in o.data for o in cap.outputs)


def test_dist_mem_estimates_the_mesh_strategies(shell, no_group):
    with capture_output() as cap:
        shell.run_line_magic("dist_mem", "--model 7.5B --strategies ddp,tp,fsdp2+tp,hsdp,pp "
                                         "--world-sizes 4")
    table = cap.outputs[0].data
    for name in ("tp", "fsdp2+tp", "hsdp", "pp"):
        assert f"{name}: " in table["text/plain"]  # a row and its formula
    assert "PP: the stage's layers" in table["text/plain"]
    assert any("image/png" in o.data for o in cap.outputs)


def test_dist_mem_measures_the_mesh_strategies(shell, dist_group):
    with capture_output() as cap:
        shell.run_line_magic("dist_mem", "--model mlp:2x64 --strategies tp,fsdp2+tp,hsdp "
                                         "--steps 1 --batch 4 --no-plot")
    text = cap.outputs[0].data["text/plain"]
    assert all(name in text for name in ("tp", "fsdp2+tp", "hsdp")) and len(cap.outputs) == 1


def test_dist_mem_refuses_strategy_options(shell, no_group):
    with pytest.raises(UsageError, match=r"--strategies takes strategy names only, got "
                                         r"'fsdp2\+tp:tp=2': the mesh strategies use their "
                                         r"default sizes here \(nbdist.strategies.mesh_sizes\)"):
        shell.run_line_magic("dist_mem", "--model 7.5B --strategies ddp,fsdp2+tp:tp=2")


def test_dist_mem_takes_a_model_factory_from_the_notebook(shell, dist_group):
    shell.run_cell("import torch\ndef tiny():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8))")
    with capture_output() as cap:
        shell.run_line_magic("dist_mem", "--model tiny --strategies ddp --steps 1 --no-plot")
    assert len(cap.outputs) == 1 and "ddp" in cap.outputs[0].data["text/html"]  # no plot


def test_dist_mem_usage_errors(shell, dist_group):
    with pytest.raises(UsageError, match="--model takes mlp:LAYERSxWIDTH.*\nusage: %dist_mem"):
        shell.run_line_magic("dist_mem", "--model banana")
    with pytest.raises(UsageError, match="usage: %dist_mem"):
        shell.run_line_magic("dist_mem", "--steps x")


def test_dist_mem_needs_a_group_to_measure(shell, no_group):
    with pytest.raises(UsageError, match="no nbdist group is running"):
        shell.run_line_magic("dist_mem", "--model mlp:2x8")


def test_dist_bench_shows_a_table_and_plots(shell, dist_group):
    with capture_output() as cap:
        shell.run_line_magic("dist_bench", "--ops all_reduce,barrier --sizes 4K-16K --iters 2 --warmup 1")
    html = "".join(o.data.get("text/html", "") for o in cap.outputs)
    assert "all_reduce" in html and "barrier" in html
    assert any("image/png" in o.data for o in cap.outputs)


def test_dist_bench_usage_errors(shell, dist_group):
    with pytest.raises(UsageError, match="usage: %dist_bench"):
        shell.run_line_magic("dist_bench", "--ops nope --no-plot")
    with pytest.raises(UsageError, match="usage: %dist_bench"):
        shell.run_line_magic("dist_bench", "--sizes banana --no-plot")


def test_dist_cell_trace_shows_the_collectives(shell, dist_group):
    with capture_output() as cap:
        shell.run_cell_magic("dist", "--trace -q",
                             "t = torch.ones(1000)\nfor _ in range(3):\n    dist.all_reduce(t)\n")
    text = "".join(o.data.get("text/plain", "") for o in cap.outputs)
    assert "all_reduce" in text
    assert any("image/png" in o.data for o in cap.outputs)
    assert dist_group.exec("1") == [1, 1]
