"""A background job that hits a breakpoint (issue 27) pauses there, from the Python API: its state
says where, waiting on it says so instead of hanging, its timeout and stall watch wait, and
``job.debug()`` answers the rank's live pdb -- ``c`` lets it finish, ``q`` ends it with an error,
and interrupting it leaves the group usable. The notebook side: tests/notebooks/test_debug_kernel.py."""
import threading
import time

import pytest

import nbdist

pytestmark = pytest.mark.timeout(120)

CODE = """x = 41 + rank
if rank == 1:
    breakpoint()
y = x + 1
t = torch.ones(1)
dist.all_reduce(t)
y * 10 + t.item()
"""


@pytest.fixture(scope="module")
def group():
    with nbdist.start(2, stall=1.0) as g:
        yield g


def paused(job) -> dict:
    assert not job.wait(60), "the job ended instead of pausing"  # wait() returns once paused
    return job.paused


def test_a_paused_job_waits_past_its_timeout_and_stall_then_c_finishes_it(group):
    job = group.submit_exec(CODE, timeout=2.0, name="bp")
    where = paused(job)
    assert list(where) == [1] and where[1].endswith(":4 (<module>)"), where
    time.sleep(3.0)  # past the job's 2 s timeout and 1 s stall time, on purpose
    assert job.state == "paused" and job.stalled is None and job.running()
    assert "bp': paused, " in job.describe()
    assert f"rank 1 at a breakpoint, {where[1]} (timeout and stall watch suspended; attach " \
           "with %dist_debug bp or job.debug())" in job.describe()
    with pytest.raises(nbdist.JobPausedError) as info:
        job.result()  # no timeout: said at once instead of waiting forever
    assert str(info.value).startswith(f"job 'bp' is paused: rank 1 at a breakpoint, {where[1]}, "
                                      "waiting for a debugger;")
    assert info.value.job is job
    assert job.debug().endswith("(4)<module>()\n-> y = x + 1\n")
    assert job.debug("p x") == "42\n"
    assert job.debug("n").endswith("(5)<module>()\n-> t = torch.ones(1)\n")
    assert job.debug("p y", rank=1) == "43\n"
    assert job.debug("c") == ""
    assert job.result(60) == [422.0, 432.0]  # rank 0 waited in the all_reduce meanwhile
    assert job.state == "done" and job.paused is None


def test_q_ends_the_job_with_an_error_and_the_group_stays_usable(group):
    job = group.submit_exec("z = 5\nif rank == 1:\n    breakpoint()\nz", name="bq")
    paused(job)
    with pytest.raises(LookupError, match=r"rank 0 of job 'bq' is not at a breakpoint; rank 1 "
                                          r"is \(--rank R / rank=R\)"):
        job.debug("p z", rank=0)
    assert job.debug("q") == ""
    with pytest.raises(nbdist.RemoteError) as info:
        job.result(60)
    assert "pdb was quit (q) on rank 1: the call ended there" in str(info.value)
    with pytest.raises(LookupError, match=r"job 'bq' is not at a breakpoint \(it is failed\)"):
        job.debug()
    assert group.exec("z") == [5, 5]  # the ranks kept their variables


def test_interrupting_a_paused_job_quits_pdb_and_keeps_the_group(group):
    job = group.submit_exec("if rank == 1:\n    breakpoint()\n1", name="bi")
    paused(job)
    job.interrupt()
    with pytest.raises(nbdist.GroupInterrupted, match="group is still usable"):
        job.result(60)
    assert group.run(lambda: 2) == [2, 2]


def test_a_breakpoint_in_a_call_from_another_thread_continues_saying_so(group):
    got = []
    caller = threading.Thread(target=lambda: got.append(
        group.exec("if rank == 1:\n    breakpoint()\nrank * 3")))
    caller.start()
    caller.join(60)
    assert got == [[0, 3]]  # nothing could prompt there: the rank went on
    assert any(line.startswith("nbdist: rank 1 hit a breakpoint in a call made from a thread "
                               "other than the notebook's; it continues (nothing can prompt "
                               "there") for line in group.last_output[1]), group.last_output
