"""``%dist_start --on ENGINE``: the engine's flags are refused without an engine, and an engine's
errors come back as ``UsageError`` with the magic's usage -- nothing started, nothing queued (the
real SLURM runs of the magic are in tests/integration/test_engine_slurm.py)."""
import sys

import pytest
from IPython.core.error import UsageError


def test_engine_flags_need_an_engine(shell, no_group):
    with pytest.raises(UsageError, match="--nodes, --partition: options of an engine that places "
                                         "the ranks; add --on slurm, --on ray"):
        shell.run_line_magic("dist_start", "-n 2 --nodes 2 --partition gpu")
    with pytest.raises(UsageError, match="--placement: options of an engine"):
        shell.run_line_magic("dist_start", "-n 2 --placement SPREAD")


def test_an_unknown_engine_and_a_bad_layout_are_usage_errors(shell, no_group):
    with pytest.raises(UsageError, match="unknown engine on='nowhere'; the engines are: 'local', "
                                         "'slurm', 'ray', 'k8s'"):
        shell.run_line_magic("dist_start", "-n 2 --on nowhere")
    with pytest.raises(UsageError, match="world_size=3 does not divide into nodes=2"):
        shell.run_line_magic("dist_start", "-n 3 --on slurm --nodes 2 --sbatch-arg=--mem=1G")
    with pytest.raises(UsageError, match="placement must be one of PACK, SPREAD, STRICT_SPREAD, "
                                         "STRICT_PACK, got 'TIGHT'"):
        shell.run_line_magic("dist_start", "-n 2 --on ray --placement TIGHT")
    with pytest.raises(UsageError, match=r"expected NAME=NUMBER \(e.g. TPU=1\), got 'TPU'"):
        shell.run_line_magic("dist_start", "-n 2 --on ray --resource TPU")


def test_keep_alive_needs_an_engine_and_reattach_a_saved_group(shell, no_group, tmp_path,
                                                               monkeypatch):
    from nbdist import NbdistError

    with pytest.raises(UsageError, match="--keep-alive: options of an engine that places the "
                                         "ranks; add --on slurm"):
        shell.run_line_magic("dist_start", "-n 2 --keep-alive 30m")
    with pytest.raises(UsageError, match="keep_alive must be a duration"):
        shell.run_line_magic("dist_start", "-n 2 --on slurm --nodes 2 --keep-alive soon")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(NbdistError, match=r"reattach\(\): no saved nbdist group in "):
        shell.run_line_magic("dist_start", "--reattach")


def test_the_k8s_flags_reach_the_engine(shell, no_group):
    with pytest.raises(UsageError, match="--image, --gpus: options of an engine that places the "
                                         "ranks; add --on slurm, --on ray, --on k8s"):
        shell.run_line_magic("dist_start", "-n 2 --image nb:1 --gpus 2")
    with pytest.raises(UsageError, match="world_size=2 is not a multiple of gpus=3"):
        shell.run_line_magic("dist_start", "-n 2 --on k8s --image nb:1 --namespace team --gpus 3")


def test_the_launcher_panel_lists_where_the_ranks_can_run(panels, monkeypatch):
    from traitlets import TraitError

    from nbdist.ui import launcher

    monkeypatch.setenv("PATH", "/nonexistent")  # no SLURM here, whatever the machine has
    monkeypatch.setitem(sys.modules, "ray", None)  # and no Ray (as where it is not installed)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")  # nor a Kubernetes cluster
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    ui = panels(launcher)
    assert ui._controls["where"].options == ("local",) and ui.where == "local"
    note = ui._notes.value
    assert "engines not available here (3)" in note and "slurm: no sbatch on PATH" in note
    assert "ray: ray is not installed (pip install &#x27;nbdist[ray]&#x27;)" in note \
        or "ray: ray is not installed (pip install 'nbdist[ray]')" in note, note
    assert "k8s: no kubeconfig or in-cluster config" in note
    with pytest.raises(TraitError, match="the ranks cannot run on 'slurm': no sbatch on PATH"):
        ui.where = "slurm"
    with pytest.raises(TraitError, match="the ranks cannot run on 'ray': ray is not installed"):
        ui.where = "ray"
    with pytest.raises(TraitError, match="the ranks cannot run on 'mars': it is not an engine"):
        ui.where = "mars"


def test_the_launcher_panel_offers_ray_where_it_is_installed(panels, monkeypatch):
    pytest.importorskip("ray", reason="Ray is not installed here (pip install 'nbdist[ray]')")
    from nbdist.ui import launcher

    ui = panels(launcher)
    assert "ray" in ui._controls["where"].options
    ui.where = "ray"  # usable: accepted (nothing starts until the start button)
