"""Tutorial 12 ("From this laptop to a cluster") runs in real kernels against the local SLURM of
tests/integration/slurm_helpers.py (skipped, saying why, where that cannot start). The notebook asks
for a kernel restart at the cell tagged ``restart-kernel``: the cells before it run in one kernel,
which is then shut down (its keep_alive group outlives it), the cells after it in a new one, up to
the cell tagged ``ray-section``. The Ray section runs in a kernel of its own (it starts Ray on this
machine), skipped, saying why, where Ray is not installed."""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from slurm_helpers import LocalSlurm  # noqa: E402

from test_tutorials import NOTEBOOKS, _text  # noqa: E402

pytestmark = pytest.mark.timeout(420)
NAME = "12_from_this_laptop_to_a_cluster.ipynb"


@pytest.fixture
def cluster(monkeypatch):
    home = Path(tempfile.mkdtemp(prefix="nbdist-tutorial12-"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(home / "runtime"))  # the kernels' handle dir
    c = LocalSlurm(home / "cluster")
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(home, ignore_errors=True)


def _run(cells, tmp_path):
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {
        "display_name": "Python 3", "language": "python", "name": "python3"}})
    NotebookClient(nb, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    return [_text(c) for c in nb.cells if c.cell_type == "code"]


def _tagged(nb, tag) -> int:
    found = [i for i, c in enumerate(nb.cells) if tag in c.metadata.get("tags", [])]
    assert len(found) == 1, f"the notebook tags one cell {tag!r}"
    return found[0]


def test_tutorial_12_submits_restarts_the_kernel_and_reattaches(cluster, tmp_path):
    nb = nbformat.read(NOTEBOOKS / NAME, as_version=4)
    cut, ray_part = [_tagged(nb, "restart-kernel")], _tagged(nb, "ray-section")
    first = _run(nb.cells[:cut[0]], tmp_path)
    assert "'slurm': None" in first[0]
    assert "rank 0 of 2 on SLURM node n1" in "".join(first) and \
        "rank 1 of 2 on SLURM node n2" in "".join(first)
    assert "[[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]" in "".join(first)
    assert "SLURM refused the job: sbatch: error: Batch job submission failed: Requested time " \
        "limit is invalid" in "".join(first)
    assert len(cluster.jobs()) == 1  # the first kernel is gone; its job is not
    second = "".join(_run(nb.cells[cut[0]:ray_part], tmp_path))
    assert "rank 0: weights = [1.0, 1.0, 1.0]" in second and \
        "rank 1: weights = [2.0, 2.0, 2.0]" in second
    assert "[2.0, 2.0]" in second  # dist.new_group after the reattach
    assert "squeue: empty" in second
    cluster.wait_empty(15.0)


def test_tutorial_12_ray_section_starts_trains_twice_and_leaves_no_actor(tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="Ray is not installed here (pip install 'nbdist[ray]')")
    from ray_helpers import cluster_env

    monkeypatch.setenv("PYTHONPATH", cluster_env()["PYTHONPATH"])  # nbdist for Ray's workers
    nb = nbformat.read(NOTEBOOKS / NAME, as_version=4)
    out = _run(nb.cells[_tagged(nb, "ray-section"):], tmp_path)
    text = "".join(out)
    assert "rank 0 of 2: LOCAL_RANK=0 GROUP_RANK=0 Ray node" in text and \
        "rank 1 of 2: LOCAL_RANK=1 GROUP_RANK=0 Ray node" in text, text
    assert "[3.0, 3.0, 3.0]" in text
    losses = [float(o.split("loss ")[1].split()[0]) for o in out if "loss " in o]
    assert len(losses) == 2 and losses[1] < losses[0]  # the second run went on from the first
    assert "actors alive: []" in text and "placement groups: []" in text, text
