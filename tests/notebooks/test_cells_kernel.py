"""Code from a cell, named by its cell on the ranks, in a real Jupyter kernel (nbclient, issue 35):
a function defined in a cell fails on the ranks as ``Cell In[N], line L`` with its line, and
``g.stacks()`` of a running job shows the cell, the line number and the line. No ``%load_ext``:
``import nbdist`` in a kernel names the cells. nbdist's note about threads shows on stdout there
(a note, not an error)."""
from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

CELLS = [
    "import nbdist, time\ng = nbdist.start(2, backend='gloo', device='cpu')",          # In[1]
    "def scale(x):\n    y = x * 2\n    if y > 10:\n"                                    # In[2]
    "        raise ValueError(f'too big {y}')\n    return y",
    "try:\n    g.run(scale, 21)\nexcept nbdist.RemoteError as err:\n    print(err)",     # In[3]
    "def slow():\n    time.sleep(3)\n    return rank\n"                                    # In[4]
    "job = g.submit(slow)\ntime.sleep(1)\nprint(g.stacks())\nprint(job.result())",
    "g.stop()",
]


def stdout(cell) -> str:
    return "".join(o["text"] for o in cell.outputs
                   if o["output_type"] == "stream" and o["name"] == "stdout")


@pytest.mark.timeout(180)
def test_cell_and_line_of_remote_code_in_a_real_kernel():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    start, _, failed, stacks, _ = nb.cells
    assert "nbdist: torch uses " in stdout(start)
    text = stdout(failed)
    assert text.startswith("ValueError on ranks 0, 1: too big 42"), text
    assert "Traceback (most recent call last):\n  Cell In[2], line 4, in scale\n" \
           "    raise ValueError(f'too big {y}')\nValueError: too big 42" in text, text
    text = stdout(stacks)
    assert "--- ranks 0, 1 ---\n    Cell In[4], line 2, in slow\n      time.sleep(3)\n" in text, \
        text
    assert text.rstrip().endswith("[0, 1]")
