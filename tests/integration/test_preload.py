"""Group.preload: imports begun on the ranks in a thread of their own; NBDIST_PRELOAD: modules the
forkserver imports once for every rank (real ranks)."""
import json
import os
import re
import subprocess
import sys

import pytest

import nbdist
from nbdist.runtime.forkserver import start_methods

pytestmark = pytest.mark.timeout(120)


def _imported():
    import sys

    return ["colorsys" in sys.modules, "xml.dom.minidom" in sys.modules]


def test_preload_begins_imports_on_every_rank_and_keeps_the_last_calls_metrics(shared_group):
    g = shared_group
    assert g.run(_imported) == [[False, False]] * 2
    g.exec("import nbdist\nnbdist.log(step=1, loss=0.5)")
    assert len(g.metrics) == 2
    assert g.preload("colorsys", "xml.dom.minidom") is True
    assert len(g.metrics) == 2  # preloading is not "the last call"
    assert g.run(_imported) == [[True, True]] * 2  # imported before this call started
    assert g.preload("colorsys") is True  # done already: no call


def test_a_module_missing_on_the_ranks_is_named_and_the_group_stays_usable(shared_group):
    with pytest.raises(nbdist.RemoteError, match=r"preload: no module named 'no_such_module_x' "
                                                 r"on this rank \(python .*\); install it in the "
                                                 r"ranks' environment, or leave it out"):
        shared_group.preload("json", "no_such_module_x")
    assert shared_group.run(lambda: 1) == [1, 1]


def test_preload_does_nothing_while_a_job_runs(shared_group):
    job = shared_group.submit_exec("import time\ntime.sleep(1.0)")
    assert shared_group.preload("colorsys") is False
    job.result(timeout=30)


def _who_imported():
    import os

    import plmod

    return [plmod.PID, os.getpid(), plmod.NVML, os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")]


PLMOD = "import os\nPID = os.getpid()\nNVML = os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')\n"

# In a process of its own: the forkserver reads NBDIST_PRELOAD once, when it starts.
SCRIPT = """
import json, os
import cloudpickle, nbdist, test_preload
cloudpickle.register_pickle_by_value(test_preload)
out = {"forkserver": None, "driver": os.getpid()}
try:
    nbdist.start(2, start_method="forkserver")
except nbdist.NbdistError as err:
    out["error"] = str(err)
os.environ["NBDIST_PRELOAD"] = "plmod"
with nbdist.start(2, start_method="forkserver") as g:
    out["first"] = g.run(test_preload._who_imported)
    g.restart()
    out["restart"] = g.run(test_preload._who_imported)
from multiprocessing import forkserver
out["forkserver"] = forkserver._forkserver._forkserver_pid
print("OUT", json.dumps(out))
"""


@pytest.mark.skipif("forkserver" not in start_methods(), reason="no forkserver here")
def test_the_forkserver_imports_what_nbdist_preload_lists_once_for_every_rank(tmp_path):
    """A module NBDIST_PRELOAD lists is imported by the forkserver (torch looking for CUDA through
    NVML meanwhile): every rank, of every start, finds it imported by the forkserver's pid, not its
    own. A module that fails to import there, even by SystemExit, is skipped (the forkserver lives
    on), and fails each rank's start, named."""
    (tmp_path / "plmod.py").write_text(PLMOD)
    (tmp_path / "plbad.py").write_text("raise SystemExit(3)\n")
    here = os.path.dirname(__file__)
    env = dict(os.environ, NBDIST_PRELOAD="plmod, plbad",
               PYTHONPATH=os.pathsep.join([str(tmp_path), here, os.environ.get("PYTHONPATH", "")]))
    for name in ("NBDIST_START_METHOD", "PYTORCH_NVML_BASED_CUDA_CHECK"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=100, cwd=tmp_path)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("OUT ")]
    assert lines, run.stdout + run.stderr
    out = json.loads(lines[0][4:])
    assert re.search(r"NBDIST_PRELOAD lists 'plbad', which rank \d cannot import \(SystemExit: "
                     r"3\)\. Install it in the ranks' environment, or take it out of "
                     r"NBDIST_PRELOAD \(it is 'plmod, plbad'\)\.", out["error"]), out["error"]
    server = out["forkserver"]
    for ranks in (out["first"], out["restart"]):
        assert [r[0] for r in ranks] == [server, server]  # imported once, by the forkserver
        assert [r[2:] for r in ranks] == [["1", None]] * 2  # NVML while it imported; not after
        pids = {r[1] for r in ranks}
        assert len(pids) == 2 and not pids & {server, out["driver"]}


def test_a_spawned_rank_imports_what_nbdist_preload_lists_itself(tmp_path, monkeypatch):
    (tmp_path / "plmod.py").write_text(PLMOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NBDIST_PRELOAD", "plmod")
    monkeypatch.setenv("NBDIST_SPARES", "0")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    with nbdist.start(2, start_method="spawn") as g:
        assert [[imported == rank, nvml] for imported, rank, nvml, _ in g.run(_who_imported)] \
            == [[True, None]] * 2


def test_nbdist_preload_is_checked_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("NBDIST_PRELOAD", "deepspeed,torch-dynamo ray/util")
    with pytest.raises(ValueError, match=r"NBDIST_PRELOAD must list module names separated by "
                       r"commas, e.g. 'deepspeed,torch._dynamo'; not a module name: "
                       r"'torch-dynamo', 'ray/util' \(the variable is 'deepspeed,torch-dynamo "
                       r"ray/util'\)"):
        nbdist.start(2)
    monkeypatch.setenv("NBDIST_PRELOAD", "json, no_such_module_pl.sub")
    with pytest.raises(ModuleNotFoundError, match=r"NBDIST_PRELOAD lists 'no_such_module_pl.sub', "
                       r"which this Python \(.*\) cannot find; install it, or take it out of "
                       r"NBDIST_PRELOAD \(it is 'json, no_such_module_pl.sub'\)"):
        nbdist.start(2)
    monkeypatch.delenv("NBDIST_PRELOAD")
    with nbdist.start(2) as g:
        assert g.run(abs, -1) == [1, 1]
        monkeypatch.setenv("NBDIST_PRELOAD", "no_such_module_pl")
        with pytest.raises(ModuleNotFoundError, match="NBDIST_PRELOAD lists 'no_such_module_pl'"):
            g.restart()  # refused before the running ranks were stopped
        assert g.state == "ready" and g.run(abs, -2) == [2, 2]


def test_the_forkserver_s_cuda_probe_setting_is_put_back(monkeypatch):
    from nbdist.runtime import imports

    monkeypatch.setenv("NBDIST_PRELOAD", "json")
    for before in (None, "0"):
        if before is None:
            monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", before)
        imports.from_env(strict=False)
        assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == before
