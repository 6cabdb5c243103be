"""Quiet ranks in a real Jupyter kernel (nbclient, issue 18): a warning every rank prints every
step shows once in the cell, labelled with the ranks, with a summary at the end; per-rank lines
show per rank, in order; ``--all-output`` shows everything; a background job's output folds too."""
from __future__ import annotations

import re

import nbformat
import pytest
from nbclient import NotebookClient

STEPS = 6
TRAIN = ("import warnings\n"
         "warnings.simplefilter('always')\n"
         f"for step in range({STEPS}):\n"
         "    warnings.warn('old_api is deprecated, use new_api', FutureWarning)\n"
         "    t = torch.ones(1); dist.all_reduce(t)\n"
         "    print(f'step {step} loss {rank * 10 + step}')\n")
CELLS = {
    "start": "%load_ext nbdist\n%dist_start -n 2",
    "quiet": "%%dist\n" + TRAIN,
    "all": "%%dist --all-output\n" + TRAIN,
    "bg": "get_ipython().run_cell_magic('dist', '--bg job', 'for i in range(25): print(\"tick\")')\n"
          "get_ipython().run_line_magic('dist_wait', 'job --quiet')\n"  # sends its display
          "print('kept', [job.output[r].count('tick') for r in (0, 1)])",
    "kept": "from nbdist.ui.magics import current_group\n"
            "print('dedupe', current_group().dedupe_output)",
    "stop": "%dist_stop",
}


def streams(cell):
    """``(stdout, stderr)`` text of a cell."""
    text = {"stdout": "", "stderr": ""}
    for o in cell.outputs:
        if o["output_type"] == "stream":
            text[o["name"]] += o["text"]
    return text["stdout"], text["stderr"]


@pytest.mark.timeout(240)
def test_quiet_ranks_in_a_real_kernel():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src, metadata={"name": name})
                for name, src in CELLS.items()]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    cells = {c.metadata["name"]: c for c in nb.cells}

    out, err = streams(cells["quiet"])
    warning = [line for line in err.splitlines() if "FutureWarning: old_api" in line]
    assert len(warning) == 2, err  # shown once, then in the summary
    assert warning[0].startswith("[ranks 0, 1] Cell In[2]:5: FutureWarning"), warning  # its cell
    assert warning[1].startswith(f"[ranks 0, 1: {STEPS} times each] Cell In[2]:5: ")
    assert "nbdist: repeated lines were shown once" in err
    for rank in (0, 1):  # per-rank lines: all of them, in order
        assert re.findall(rf"^\[rank {rank}\] (.*)$", out, re.M) == \
            [f"step {s} loss {rank * 10 + s}" for s in range(STEPS)]

    out, err = streams(cells["all"])
    assert err.count("FutureWarning: old_api") == 2 * STEPS and "repeated lines" not in err
    assert len(re.findall(r"^\[rank \d\] step", out, re.M)) == 2 * STEPS

    out, _ = streams(cells["bg"])  # the job's lines: in its display (nbdist.ui.joboutput)
    out += "".join(o.get("data", {}).get("text/plain", "") for o in cells["bg"].outputs)
    ticks = re.findall(r"^\[([^\]]+)\] tick$", out, re.M)
    assert ticks[-1] == "ranks 0, 1: 25 times each" and len(ticks) <= 3, out
    assert "kept [25, 25]" in out
    assert "dedupe True" in streams(cells["kept"])[0]
