"""Code from a cell, named by its cell on the ranks (issue 35), in the in-process IPython shell
with a real group: a function, lambda or class defined in a cell and run with ``g.run`` /
``g.submit``, and ``%%dist`` / ``%dist`` / ``g.exec`` source, show as ``Cell In[N], line L`` with
the line in a RemoteError, ``g.stacks()``, the collectives' analysis, pdb, warnings and a
timed-out collective's hint. Cells run with ``store_history=True``, as a notebook's do."""
from __future__ import annotations

import time

import pytest
from IPython.utils.capture import capture_output

import nbdist

pytestmark = pytest.mark.timeout(120)


def cell(shell, source):
    """Run ``source`` as notebook cell ``In[N]``; return ``(N, result, captured)``."""
    n = shell.execution_count
    with capture_output() as captured:
        result = shell.run_cell(source, store_history=True)
    return n, result, captured


def test_a_cells_function_fails_on_the_ranks_at_its_cell_and_line(shell, dist_group):
    shell.user_ns["g"] = dist_group
    n, _, _ = cell(shell, "def scale(x):\n    y = x * 2\n    if y > 10:\n"
                          "        raise ValueError(f'too big {y}')\n    return y\n")
    _, result, _ = cell(shell, "g.run(scale, 21)")
    err = result.error_in_exec
    assert isinstance(err, nbdist.RemoteError), err
    text = str(err)
    assert f"  Cell In[{n}], line 4, in scale\n    raise ValueError(f'too big {{y}}')\n" in text
    assert "<dynamic-code>" not in text and "nbdist/runtime" not in text
    where = dist_group.debug("where", rank=1)  # post-mortem pdb lists the cell's lines
    assert f"Cell In[{n}](4)scale()" in where, where
    listing = dist_group.debug("ll", rank=1)
    assert "  4  ->\t        raise ValueError(f'too big {y}')" in listing, listing
    _, result, _ = cell(shell, "g.run(lambda: scale(1))")  # its cell's text is on the ranks now
    assert result.result == [2, 2]


def test_lambdas_and_classes_from_a_cell_keep_their_cell(shell, dist_group):
    shell.user_ns["g"] = dist_group
    n, _, _ = cell(shell, "class Box:\n    def open(self):\n        return 1 / 0\n"
                          "opener = lambda: Box().open()\n")
    _, result, _ = cell(shell, "g.run(opener)")
    text = str(result.error_in_exec)
    assert f"Cell In[{n}], line 4, in <lambda>\n" in text
    assert f"Cell In[{n}], line 3, in open\n    return 1 / 0\n" in text


def test_a_running_jobs_stacks_and_collectives_point_into_the_cell(shell, dist_group):
    shell.user_ns["g"] = dist_group
    n, _, _ = cell(shell, "import time\n"
                          "def step():\n"
                          "    if rank == 1:\n"
                          "        time.sleep(4)            # a slow loader\n"
                          "    t = torch.ones(1)\n"
                          "    dist.all_reduce(t)\n"
                          "    return t.item()\n")
    cell(shell, "job = g.submit(step)")
    job = shell.user_ns["job"]
    try:
        deadline = time.monotonic() + 10
        while True:
            stacks = dist_group.stacks()
            if "all_reduce" in " ".join(f[2] for f in stacks.frames(0)) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        text, summary = str(stacks), stacks.summary()
        assert f"    Cell In[{n}], line 4, in step\n      time.sleep(4)            # a slow loader" \
            in text, text
        assert f"    Cell In[{n}], line 6, in step\n      dist.all_reduce(t)" in text, text
        assert f"rank 1 never reached collective #" in summary and \
            f"it is at Cell In[{n}]:4 step." in summary, summary
        assert f"rank 1: Cell In[{n}]:4 step" in summary.splitlines(), summary
    finally:
        assert job.result(timeout=30) == [2.0, 2.0]


def test_dist_cells_and_statements_count_lines_in_their_cell(shell, dist_group):
    shell.user_ns["g"] = dist_group
    n, result, _ = cell(shell, "%%dist\nx = 1\nraise KeyError(x)")
    text = "\n".join(result.error_in_exec._render_traceback_())
    assert f"  Cell In[{n}], line 3, in <module>\n    raise KeyError(x)\n" in text
    n, result, _ = cell(shell, "a = 1\n%dist --ranks 0 y = 1 / 0")
    text = str(result.error_in_exec)
    assert f"  Cell In[{n}], line 2, in <module>\n    %dist --ranks 0 y = 1 / 0\n" \
           "                        ~~^~~\n" in text, text  # the caret under the statement
    n, result, _ = cell(shell, "g.exec('''\ndef f():\n    return missing\n''')\ng.exec('f()')")
    text = str(result.error_in_exec)
    assert f"  Cell In[{n}], line 5, in <module>\n    g.exec('f()')\n" in text, text
    assert f"  Cell In[{n}], line 3, in f\n    return missing\n" in text, text
    n, result, _ = cell(shell, "g.exec('x = 1\\n' + 'y = nothing')")  # built in code
    assert f'File "<string in Cell In[{n}]>", line 2, in <module>\n    y = nothing\n' in \
        str(result.error_in_exec)


def test_warnings_on_the_ranks_name_the_cell(shell, dist_group):
    shell.user_ns["g"] = dist_group
    n, result, captured = cell(shell, "import warnings\ndef warn():\n"
                                      "    warnings.warn('careful', UserWarning)\ng.run(warn)")
    assert result.error_in_exec is None
    assert f"[ranks 0, 1] Cell In[{n}]:3: UserWarning: careful\n" in captured.stderr, \
        captured.stderr
    assert "warnings.warn('careful', UserWarning)" in captured.stderr


@pytest.mark.timeout(180)
def test_a_timed_out_collective_says_what_each_rank_called(shell):
    with nbdist.start(2, backend="gloo", device="cpu", timeout=3) as g:
        shell.user_ns["g"] = g
        cell(shell, "def log_metrics():\n    w = torch.ones(1)\n    if rank == 0:\n"
                    "        dist.all_reduce(w)\n    else:\n        dist.broadcast(w, src=0)\n")
        _, result, _ = cell(shell, "g.run(log_metrics)")
    text = str(result.error_in_exec)
    assert "debug='detail'" not in text, text
    assert "Mismatched collectives: rank 0 failed in all_reduce #1 (1 float32); rank 1 failed " \
           "in broadcast #1 (1 float32)." in text, text
