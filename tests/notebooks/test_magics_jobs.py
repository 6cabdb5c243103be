"""%%dist --bg, %dist_jobs, %dist_wait (and its progress bar), the live view's Interrupt button
and its redraw cadence, through a real IPython shell and real ranks (issue 17)."""
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


def test_wait_shows_a_progress_bar_of_the_logged_steps(shell, dist_group):
    """tqdm (the console bar in this shell, on stderr) counts the slowest rank's steps, named
    after the job, and ends at the last step, as a full bar: the total is known by then."""
    import re

    shell.run_cell_magic("dist", "--bg stepping -q", "import time, nbdist\nfor i in range(40):\n"
                         "    nbdist.log(step=i, loss=1.0)\n    time.sleep(0.05)")
    with capture_output() as out:
        shell.run_line_magic("dist_wait", "-q stepping")
    frames = [f.strip() for f in out.stderr.split("\r") if f.strip()]
    assert frames and all(f.startswith("stepping: ") for f in frames), frames  # not "job stepping"
    counts = [int(n) for n in re.findall(r"stepping: (\d+) steps", out.stderr)]
    assert counts == sorted(counts) and max(counts, default=0) <= 40, frames  # only forward
    assert re.match(r"stepping: 100%\|.*\| 40/40 \[", frames[-1]), frames[-1]


def test_the_live_view_of_a_job_paused_at_a_breakpoint_waits_between_refreshes(
        shell, dist_group, monkeypatch):
    """Issue 34, risk 2: ``Job.wait()`` returns at once while the job is paused at a breakpoint,
    and the view's loop had no other wait: it refreshed -- widget updates -- as fast as it could
    for as long as the pause lasted, a core spinning. Refreshes stay at least half the view's
    period apart (its shortest wait), counted over a pause of 2 s and more."""
    from nbdist.ui import live

    refreshed = []
    refresh = live.Watch.refresh

    def counted(view):
        refreshed.append(time.monotonic())
        refresh(view)

    monkeypatch.setattr(live.Watch, "refresh", counted)
    job = shell.run_cell_magic("dist", "--bg pausing -q", "x = 1\nif rank == 1:\n"
                               "    breakpoint()\nx + rank")
    assert not job.wait(60) and job.paused, job.describe()  # wait() returns once paused
    with capture_output():
        view = live.watch(job)
        time.sleep(2.0)  # the pause lasts
        during = list(refreshed)
        assert job.paused and job.debug("c") == ""
        assert job.wait(60) and job.result() == [1, 2]
        view.join(30)
    span = during[-1] - during[0]
    assert len(during) - 1 <= span / (live.MIN_EVERY / 2) + 1, (len(during), span)
    assert view.button.disabled  # it noticed the end as before


SPIN = ("import time, nbdist\nfor i in range(10**6):\n    nbdist.log(step=i, x=i)\n"
        "    time.sleep(0.01)")


def test_the_live_views_interrupt_button_interrupts_the_job(shell, dist_group):
    from nbdist.ui import live

    job = shell.run_cell_magic("dist", "--bg spinning -q", SPIN)
    with capture_output():
        view = live.watch(job)
    assert not view.button.disabled and job.running()
    view.button.click()  # what a click in the notebook does
    assert job.wait(30), "the Interrupt button did not stop the job"
    assert job.state == "interrupted"
    with pytest.raises(nbdist.GroupInterrupted):
        job.result()
    view.join(30)
    assert view.button.disabled  # the view's last redraw disables it
    assert view.button.layout.display == "none"  # and hides it: a saved page shows no dead button
    if dist_group.state == "broken":  # a rank was inside a collective of the runtime
        dist_group.restart()
    assert dist_group.run(lambda: 5) == [5, 5]


def test_the_live_view_redraws_at_most_every_half_second(shell, dist_group, monkeypatch):
    """The ranks log 2 scalars every millisecond or so for 3 s; the drawing is made cheap, so only
    the view's cadence limits its redraws: no more than one per 0.5 s (+2: the first figure and
    the last one)."""
    from nbdist.ui import live

    drawn = []

    def cheap(view):
        drawn.append(time.monotonic())
        return {"text/plain": f"{len(view.job.metrics)} rows"}

    monkeypatch.setattr(live.Watch, "_figure_bundle", cheap)
    t0 = time.monotonic()
    job = shell.run_cell_magic("dist", "--bg fast -q", "import time, nbdist\n"
                               "end = time.monotonic() + 3.0\ni = 0\n"
                               "while time.monotonic() < end:\n"
                               "    nbdist.log(step=i, a=i, b=-i); i += 1\n    time.sleep(0.001)")
    with capture_output():
        view = live.watch(job)
        assert job.wait(60)
        view.join(30)
    elapsed = time.monotonic() - t0
    assert job.state == "done" and len(job.metrics) > 1000  # fast logging indeed
    assert 2 <= view.redraws <= elapsed / live.MIN_EVERY + 2, (view.redraws, elapsed)
    assert len(drawn) <= elapsed / live.MIN_EVERY + 2, (len(drawn), elapsed)


def test_dist_stacks_shows_where_a_background_job_is(shell, dist_group):
    job = shell.run_cell_magic("dist", "--bg napping", "import time\ndef nap():\n    time.sleep(30)"
                                                        "\nnap()")
    try:
        deadline = time.monotonic() + 20
        while True:
            stacks = shell.run_line_magic("dist_stacks", "")
            if stacks.summary().endswith(" nap") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        (line,) = stacks.summary().splitlines()
        assert line.startswith("ranks 0, 1: <dist-cell-") and line.endswith(" nap"), line
        one = shell.run_line_magic("dist_stacks", "--all --ranks 1 --timeout 10")
        assert list(one.by_rank) == [1] and "thread MainThread (main):" in str(one)
        with pytest.raises(UsageError, match="dist_stacks"):
            shell.run_line_magic("dist_stacks", "--ranks 7")
    finally:
        job.interrupt()
        job.wait(30)
