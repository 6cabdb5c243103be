"""The live view, the progress bar of ``%dist_wait`` and ``%dist_jobs`` as a reader sees them
(issues 27 and 28), through a real IPython shell and real ranks."""
import time

import pytest

import nbdist

pytestmark = pytest.mark.timeout(120)

STALLS = ("import time, nbdist\n"
          "nbdist.log(step=0, loss=1.0)\n"
          "if rank == 1:\n"
          "    time.sleep(8)\n"
          "dist.all_reduce(torch.ones(4))\n"
          "rank")


def test_a_stalled_jobs_live_view_says_so_and_where_the_ranks_are(shell):
    pytest.importorskip("ipywidgets")
    from nbdist.ui.live import Watch

    with nbdist.start(2, backend="gloo", device="cpu", timeout=60, stall=2) as g:
        job = g.submit_exec(STALLS)
        view = Watch(job)  # not shown: the test reads what it would show
        deadline = time.monotonic() + 7  # stall=2: seen within seconds, before rank 1 wakes
        while job.state != "stalled" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.state == "stalled", job.describe()
        view.refresh()  # not shown: only the status line is brought up to date
        status = view.status.value
        assert "stalled" in status and "rank 1 never reached collective #1" in status, status
        title = view.figure().get_suptitle()
        assert title.startswith("stalled: nothing logged or printed and no collective completed "
                                "for ") and "(nothing was killed)" in title, title
        assert "rank 1 never reached collective #1" in title, title
        assert job.wait(30) and job.result() == [0, 1]
        assert view.figure().get_suptitle() == ""  # over: no note any more


def _jobs_table(shell):
    from IPython.utils.capture import capture_output

    with capture_output() as out:
        shell.run_line_magic("dist_jobs", "")
    return out.outputs[-1].data["text/html"]


def test_dist_jobs_says_the_last_step_of_each_rank_or_that_none_was_logged(shell, dist_group):
    job = shell.run_cell_magic("dist", "--bg starting -q",
                               "import time, nbdist\ntime.sleep(1)\nfor i in range(5):\n"
                               "    nbdist.log(step=i, loss=1.0)")
    table = _jobs_table(shell)  # the ranks are still in their first second: nothing logged
    assert "<td>starting</td><td>running</td>" in table and \
        "<td>none logged yet</td>" in table, table
    assert job.wait(30)
    assert "<td>rank 0: 4, rank 1: 4</td>" in _jobs_table(shell)


def test_what_a_job_prints_after_its_cell_ended_stays_under_that_cell_in_a_saved_notebook(
        tmp_path):
    """nbclient (as ``jupyter nbconvert --execute``) keeps only the messages of the cell running
    at that moment: the job's lines, printed a second after its cell ended, must still be there."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        "%load_ext nbdist\n%dist_start -n 2",
        "%%dist --bg late -q\nimport time\ntime.sleep(1)\nprint('hello from the job')",
        "print('the next cell')",
        "%dist_wait late",
        "%dist_stop")])
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = ["".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                     for o in cell.outputs) for cell in nb.cells]
    assert "[ranks 0, 1] hello from the job" in texts[1], texts
    assert not any("hello from the job" in t for i, t in enumerate(texts) if i != 1), texts
