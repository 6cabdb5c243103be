"""Engines found by name (``nbdist.start(on=...)``): the registry, a third-party engine registered
through real installation metadata (a ``.dist-info`` on ``sys.path``), and the bad input that is
refused before anything is submitted -- none of these start a process or need SLURM."""
import importlib.metadata
import json
import sys

import pytest

import nbdist
from nbdist.engines import ENTRY_POINT_GROUP, Engine, available_engines
from nbdist.engines.slurm import SlurmEngine, layout
from nbdist.engines.slurm_cli import batch_script
from nbdist.runtime.engines import load_engine


class ElsewhereEngine(Engine):
    """A third-party engine that cannot run on this machine."""

    name = "elsewhere"
    options = ("region",)

    @classmethod
    def unusable(cls):
        return "elsewhere-client is not installed"

    def launcher(self, world_size, region="eu"):
        from nbdist.runtime.launcher import LocalLauncher

        return LocalLauncher()


class PlainEngine(Engine):
    """A third-party engine that places its ranks with a plain launcher (not an AttachLauncher),
    and does not implement reattach."""

    name = "plain"

    def launcher(self, world_size):
        from nbdist.runtime.launcher import LocalLauncher

        return LocalLauncher()


class NoReattachEngine(Engine):
    """A third-party engine whose ranks join an AttachLauncher, but which does not override
    Engine.reattach: its ranks could not be taken back in a new kernel."""

    name = "noreattach"

    def launcher(self, world_size):
        from nbdist.runtime.attach import AttachLauncher

        return AttachLauncher(("127.0.0.1", 0), progress=False)


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """A package installed with an entry point in group ``nbdist.engines`` (and one that breaks)."""
    info = tmp_path / "elsewhere_engine-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: elsewhere-engine\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nelsewhere = test_engines:ElsewhereEngine\n"
        "broken = no_such_module_here:Engine\nslurm = test_engines:ElsewhereEngine\n"
        "plain = test_engines:PlainEngine\nnoreattach = test_engines:NoReattachEngine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield


def test_the_engines_are_listed_with_why_not_where_they_cannot_run(third_party, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no SLURM commands here, whatever the machine
    here = available_engines()
    # built-in first; an entry point cannot replace one
    assert list(here)[:4] == ["local", "slurm", "ray", "k8s"]
    assert here["local"] is None
    assert here["slurm"] == "no sbatch on PATH"
    assert here["elsewhere"] == "elsewhere-client is not installed"
    assert here["broken"].startswith("it failed to load: ModuleNotFoundError")
    assert load_engine("elsewhere") is ElsewhereEngine and load_engine("slurm") is SlurmEngine
    with pytest.raises(ValueError, match="the engine 'elsewhere' cannot run here: "
                                         "elsewhere-client is not installed"):
        nbdist.start(2, on="elsewhere", region="us")
    with pytest.raises(ValueError, match="the engine 'slurm' cannot run here: no sbatch on PATH"):
        nbdist.start(2, on="slurm", nodes=2)


def test_an_unknown_engine_lists_the_engines():
    with pytest.raises(ValueError, match=r"unknown engine on='kubernetes'; the engines are: "
                                         r"'local', 'slurm', 'ray', 'k8s'.* entry-point group 'nbdist.engines'"):
        nbdist.start(2, on="kubernetes")


def test_an_option_the_engine_does_not_take_names_what_it_takes():
    with pytest.raises(TypeError, match=r"start\(on='slurm'\) got 'partion', which it does not "
                                        r"take; 'slurm' takes nodes, ntasks_per_node, partition,"):
        nbdist.start(2, on="slurm", partion="gpu")
    with pytest.raises(TypeError, match="every group takes .*call_timeout"):
        nbdist.slurm.start(2, start_method="spawn")


def test_keep_alive_on_a_local_group_is_refused():
    with pytest.raises(ValueError, match="keep_alive is for groups an engine launched"):
        nbdist.start(2, keep_alive="30m")


def test_keep_alive_on_an_engine_whose_launcher_cannot_keep_the_ranks_is_refused(third_party):
    with pytest.raises(ValueError, match=r"keep_alive: the engine 'plain' places its ranks with "
                                         r"a launcher that cannot keep them past this kernel \(it "
                                         r"is not an AttachLauncher\); drop keep_alive\."):
        nbdist.start(2, on="plain", keep_alive="30m")


def test_keep_alive_on_an_engine_that_cannot_reattach_is_refused_before_anything_starts(
        third_party):
    with pytest.raises(ValueError, match=r"keep_alive: the engine 'noreattach' cannot take its "
                                         r"ranks back in a new kernel \(it has no reattach\), so "
                                         r"they could not outlive this one; drop keep_alive\."):
        nbdist.start(2, on="noreattach", keep_alive="30m")


@pytest.mark.parametrize("engine", ["local", "plain"])  # no engine class; no Engine.reattach
def test_reattach_to_a_handle_whose_engine_cannot_reattach_says_so(third_party, tmp_path,
                                                                   monkeypatch, engine):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    handle = tmp_path / f"nbdist-{engine}-5.json"
    handle.write_text(json.dumps({"job": "5", "engine": engine, "address": ["127.0.0.1", 9],
                                  "key": "00", "world_size": 2, "keep_alive": 60}))
    with pytest.raises(nbdist.NbdistError, match=rf"reattach\(\): the engine '{engine}' of "
                                                 rf".*nbdist-{engine}-5\.json cannot reattach "
                                                 r"\(it does not implement Engine\.reattach and "
                                                 r"Engine\.ended\)\. Remove that handle and "
                                                 r"start a new group\."):
        nbdist.reattach()
    assert handle.exists()  # the user's to remove, as the message says


def test_keep_alive_is_a_duration():
    from nbdist.runtime.handles import keep_alive_seconds

    assert [keep_alive_seconds(v) for v in ("30m", "90s", "2h", "1d", 45, 0.5, "10")] == \
        [1800.0, 90.0, 7200.0, 86400.0, 45.0, 0.5, 10.0]
    for bad in ("soon", 0, -3, "5 minutes", True):
        with pytest.raises(ValueError, match=r"keep_alive must be a duration: seconds \(e\.g\. "
                                             r"1800\) or a number with s, m, h or d \(e\.g\. "
                                             rf"'30m', '2h'\), more than 0; got {bad!r}"):
            nbdist.start(2, on="slurm", nodes=2, keep_alive=bad)


def test_reattach_without_a_saved_handle_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(nbdist.NbdistError, match=r"reattach\(\): no saved nbdist group in .*\. A "
                                                 r"group leaves one there when it is started "
                                                 r"with keep_alive, e\.g\. nbdist\.start\(2, "
                                                 r"on='slurm', keep_alive='30m'\)"):
        nbdist.reattach()
    (tmp_path / "nbdist-slurm-77.json").write_text('{"job": "77", "engine": "slurm"}')
    with pytest.raises(nbdist.NbdistError, match=r"no saved nbdist group for job '12' in .* "
                                                 r"\(there are handles for other jobs: "
                                                 r"nbdist-slurm-77\.json\)"):
        nbdist.reattach("12")


@pytest.mark.parametrize("ws, nodes, per_node, expected", [
    (4, 2, None, (2, 2)), (4, None, 2, (2, 2)), (3, None, None, (1, 3)), (8, 2, 4, (2, 4))])
def test_ranks_are_laid_out_evenly_on_the_nodes(ws, nodes, per_node, expected):
    assert layout(ws, nodes, per_node) == expected


def test_a_world_size_that_does_not_divide_into_the_nodes_is_refused():
    with pytest.raises(ValueError, match=r"world_size=3 does not divide into nodes=2: every node "
                                         r"runs the same number of ranks. Pass a world_size that "
                                         r"is a multiple of nodes \(e.g. 2 or 4\)"):
        nbdist.slurm.start(3, nodes=2)
    with pytest.raises(ValueError, match=r"world_size=4 does not divide into nodes=2 x "
                                         r"ntasks_per_node=3"):
        layout(4, 2, 3)
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        layout(4, 0, None)
    with pytest.raises(TypeError, match="sbatch_args must be a list of arguments"):
        nbdist.slurm.start(2, sbatch_args="--exclusive")


def test_the_batch_script_runs_the_worker_with_torchruns_variables():
    script = batch_script(["--nodes=2", "--ntasks-per-node=2"], {"PYTHONPATH": "/a b"},
                          "/opt/py/bin/python", "10.0.0.5:4242", "/home/u/.nbdist/key.hex", 2)
    lines = script.splitlines()
    assert lines[:4] == ["#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2",
                         "export PYTHONPATH='/a b'"]
    assert lines[4].startswith("exec srun --kill-on-bad-exit=1")
    for var in ("RANK=$SLURM_PROCID", "WORLD_SIZE=$SLURM_NTASKS", "LOCAL_RANK=$SLURM_LOCALID",
                "LOCAL_WORLD_SIZE=2", "GROUP_RANK=$SLURM_NODEID",
                "-m nbdist.worker --connect 10.0.0.5:4242 --key-file /home/u/.nbdist/key.hex"):
        assert var in lines[4]
    assert lines[4].endswith(" /opt/py/bin/python")


def test_nbdist_slurm_is_the_engine_module():
    import nbdist.engines.slurm

    assert nbdist.slurm is nbdist.engines.slurm
    import nbdist.slurm as alias

    assert alias is nbdist.engines.slurm and sys.modules["nbdist.slurm"] is alias
    assert importlib.metadata  # the entry points above are read through it


def test_a_job_that_cannot_be_cancelled_says_how_to(monkeypatch, tmp_path, capsys):
    from nbdist.engines.slurm_cli import cancel

    monkeypatch.setenv("PATH", str(tmp_path))  # no scancel
    cancel("4242")
    err = capsys.readouterr().err
    assert err.startswith("nbdist: could not cancel SLURM job 4242 (") and \
        err.endswith("); run `scancel 4242`.\n")


@pytest.mark.skipif(sys.platform == "win32", reason="the fake sinfo is a POSIX shell script")
def test_sinfo_timing_out_once_is_asked_again(monkeypatch, tmp_path):
    """A busy slurmctld answers sinfo with an error now and then; a lost rank's note asks again
    instead of losing SLURM's word on the node (a fake sinfo that fails on its first call)."""
    import os

    from nbdist.engines import slurm_cli

    calls = tmp_path / "calls"
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\necho x >> %s\n"
                     "[ $(wc -l < %s) -gt 1 ] || { echo 'Socket timed out' >&2; exit 1; }\n"
                     "echo 'n2|down|nbdist-test-down'\n" % (calls, calls))
    sinfo.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert slurm_cli.node_states(["n2"]) == {"n2": ("down", "nbdist-test-down")}
    assert calls.read_text().count("x") == 2
