"""The magics in a real Jupyter kernel: a notebook executed with nbclient, cell by cell.

What a user does: start a group, run ``%%dist`` cells with a collective, hit a remote error and
carry on, move a tensor in and out, interrupt a long cell, stop -- and no worker is left behind.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import nbformat
import psutil
import pytest
from nbclient import NotebookClient


def stream_text(cell, name="stdout"):
    """All the text a cell wrote to one stream."""
    return "".join(o["text"] for o in cell.outputs
                   if o["output_type"] == "stream" and o["name"] == name)


def values(cell):
    """The text/plain of the cell's display_data outputs."""
    return [o["data"]["text/plain"] for o in cell.outputs if o["output_type"] == "display_data"]


def error(cell):
    """The cell's error output."""
    (err,) = [o for o in cell.outputs if o["output_type"] == "error"]
    return err


def build_notebook(marker_dir):
    """The notebook under test; cells tagged ``raises-exception`` are expected to fail."""
    cells = {
        "start": "%load_ext nbdist\n%dist_start -n 2",
        "allreduce": "%%dist\n"
                     "t = torch.tensor([rank + 1.0])\n"
                     "dist.all_reduce(t)\n"
                     "print('sum', t.item())\n"
                     "t",
        "remote_error": "%%dist\n"
                        "if rank == 1:\n"
                        "    raise ValueError('boom on rank 1')",
        "recovered": "%dist rank * 10",
        "push": "import torch\nx = torch.arange(4.0)\n%dist_push x",
        "compute": "%%dist\ny = x * (rank + 1)",
        "pull_all": "%dist_pull y\nprint([v.tolist() for v in y])",
        "pull_one": "%dist_pull y --rank 1\nprint(y.tolist())",
        "status": "%dist_status",
        "interrupt": "%%dist\n"
                     "import pathlib, time\n"
                     f"pathlib.Path({str(marker_dir)!r}, f'sleeping-{{rank}}').touch()\n"
                     "time.sleep(120)",
        "heal": "from nbdist.ui.magics import current_group\n"
                "if current_group().state == 'broken':  # a rank was slow to react: killed\n"
                "    get_ipython().run_line_magic('dist_restart', '')",
        "after_interrupt": "%dist rank + 100",
        "stop": "import json, psutil\n"
                "pids = [r.pid for r in current_group().status().ranks]\n"
                "%dist_stop\n"
                "children = {p.pid for p in psutil.Process().children(recursive=True)}\n"
                "print(json.dumps({'pids': pids,\n"
                "                  'alive': [p for p in pids if psutil.pid_exists(p)],\n"
                "                  'children': sorted(children & set(pids))}))",
    }
    nb = nbformat.v4.new_notebook()
    for name, source in cells.items():
        cell = nbformat.v4.new_code_cell(source, metadata={"name": name})
        if name in ("remote_error", "interrupt"):
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    return nb


def interrupt_when_ranks_sleep(client, marker_dir, done):
    """Press "interrupt kernel" (SIGINT to the kernel's process group) once both ranks sleep."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        if all((marker_dir / f"sleeping-{r}").exists() for r in (0, 1)):
            os.killpg(client.km.provisioner.pgid, signal.SIGINT)
            return
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_notebook_with_magics(tmp_path):
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    nb = build_notebook(marker_dir)
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    cells = {cell.metadata["name"]: cell for cell in nb.cells}
    with client.setup_kernel():
        kernel = psutil.Process(client.km.provisioner.pid)
        for index, cell in enumerate(nb.cells):
            done = threading.Event()
            helper = None
            if cell.metadata["name"] == "interrupt":
                helper = threading.Thread(target=interrupt_when_ranks_sleep,
                                          args=(client, marker_dir, done))
                helper.start()
            try:
                client.execute_cell(cell, index)
            finally:
                done.set()
                if helper is not None:
                    helper.join()
        report = json.loads(stream_text(cells["stop"]).strip().splitlines()[-1])

    assert "nbdist: started 2 ranks (backend gloo, device cpu)" in stream_text(cells["start"])

    # the collective: each rank's output, labelled, in its own cell; then each rank's value
    allreduce = cells["allreduce"]
    assert stream_text(allreduce).splitlines() == ["[ranks 0, 1] sum 3.0"]  # the same line: once
    assert values(allreduce) == ["Out[rank 0]: tensor([3.])", "Out[rank 1]: tensor([3.])"]
    kinds = [o["output_type"] for o in allreduce.outputs]
    assert kinds.index("display_data") > kinds.index("stream")  # the output precedes the values
    assert all("sum 3.0" not in stream_text(c) for name, c in cells.items() if name != "allreduce")

    # a remote error: rank 1's traceback, not nbdist's frames; the group carries on
    err = error(cells["remote_error"])
    assert err["ename"] == "RemoteError"
    text = "\n".join(err["traceback"])
    assert "--- rank 1 ---" in text and "ValueError: boom on rank 1" in text
    assert "--- rank 0 ---" not in text and "nbdist" not in text
    assert values(cells["recovered"]) == ["Out[rank 0]: 0", "Out[rank 1]: 10"]

    # a tensor in and out
    assert stream_text(cells["pull_all"]).strip() == "[[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]]"
    assert stream_text(cells["pull_one"]).strip() == "[0.0, 2.0, 4.0, 6.0]"

    # the status table, as HTML
    (status,) = [o for o in cells["status"].outputs if o["output_type"] == "display_data"]
    assert "<table>" in status["data"]["text/html"]

    # interrupting the kernel says what happened, and the group is usable afterwards
    err = error(cells["interrupt"])
    assert err["ename"] == "GroupInterrupted"
    assert "interrupted ranks 0, 1" in err["evalue"]
    assert values(cells["after_interrupt"]) == ["Out[rank 0]: 100", "Out[rank 1]: 101"]

    # stopped: no worker alive, none among the kernel's children
    assert "nbdist: group stopped." in stream_text(cells["stop"])
    assert len(report["pids"]) == 2 and report["alive"] == [] and report["children"] == []
    assert not kernel.is_running()
    assert not [p for p in report["pids"] if psutil.pid_exists(p)]
