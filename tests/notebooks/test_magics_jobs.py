"""%%dist --bg, %dist_jobs and %dist_wait through a real IPython shell and real ranks (issue 17)."""
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import nbdist
from nbdist.ui.magics import jobs as job_magics

pytestmark = pytest.mark.timeout(120)

TRAIN = ("import time, nbdist\n"
         "for i in range(40):\n"
         "    nbdist.log(step=i, loss=1.0 / (i + 1))\n"
         "    time.sleep(0.02)\n"
         "rank * 10")


def test_bg_cell_returns_a_job_at_once_and_wait_shows_the_values(shell, dist_group):
    job = shell.run_cell_magic("dist", "--bg train", TRAIN)
    assert isinstance(job, nbdist.Job) and shell.user_ns["train"] is job
    assert job.running() and job.name == "train"
    with pytest.raises(nbdist.GroupBusyError, match="background job 'train'"):
        shell.run_cell_magic("dist", "", "rank")
    with capture_output() as out:
        shell.run_line_magic("dist_jobs", "")
    assert "job 'train': running" in "".join(o.data["text/plain"] for o in out.outputs)
    with capture_output() as out:
        shell.run_line_magic("dist_wait", "train")
    shown = [o.data["text/plain"] for o in out.outputs]
    assert shown == ["Out[rank 0]: 0", "Out[rank 1]: 10"]
    assert job.state == "done" and len(job.metrics) == 80


def test_bg_without_a_name_and_wait_for_the_latest(shell, dist_group):
    job = shell.run_cell_magic("dist", "--bg -q", "import time; time.sleep(0.5)")
    assert job.name.startswith("job")
    with capture_output():
        shell.run_line_magic("dist_wait", "-q")
    assert job.done()


def test_job_magics_refuse_bad_input_clearly(shell, dist_group):
    with pytest.raises(UsageError, match="argument --bg: expected a variable name for the job, "
                                         "e.g. train; got '1x'"):
        shell.run_cell_magic("dist", "--bg 1x", "rank")
    with pytest.raises(UsageError, match="--trace and --bg do not go together"):
        shell.run_cell_magic("dist", "--bg --trace", "rank")
    with pytest.raises(UsageError, match=r"no background job named 'nope' \(jobs: .*\); start "
                                         r"one with %%dist --bg NAME"):
        shell.run_line_magic("dist_wait", "nope")


def test_wait_raises_the_jobs_error(shell, dist_group):
    shell.run_cell_magic("dist", "--bg failing", "raise ValueError('nan loss')")
    with pytest.raises(nbdist.RemoteError, match="ValueError on ranks 0, 1: nan loss"):
        shell.run_line_magic("dist_wait", "failing")
    assert dist_group.state == "ready"


def test_job_magics_know_jobs_started_in_code(shell, dist_group):
    job = dist_group.submit(sum, [1, 2])  # not through %%dist --bg: named after the function
    job.result(timeout=30)
    with capture_output() as out:
        shell.run_line_magic("dist_jobs", "")
    assert "job 'sum': done" in "".join(o.data["text/plain"] for o in out.outputs)
    with capture_output() as out:
        shell.run_line_magic("dist_wait", "sum")
    assert "Out[rank 0]: 3" in [o.data["text/plain"] for o in out.outputs]


def test_no_jobs_yet(shell, dist_group, monkeypatch):
    monkeypatch.setattr(job_magics, "JOBS", [])
    with capture_output() as out:
        shell.run_line_magic("dist_jobs", "")
    assert "no background jobs yet" in out.stdout
    with pytest.raises(UsageError, match="no background job was started"):
        shell.run_line_magic("dist_wait", "")
    time.sleep(0)
