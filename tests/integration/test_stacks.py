"""Every rank's stack from the notebook (issue 27): Group.stacks() answers while the ranks are busy
-- in a background job, in a hung collective, in a blocking call seen from another thread -- because
each rank's watchdog thread takes it; ranks with the same stack fold together; a timeout's error
carries the stacks taken before any rank is interrupted or killed. Real groups throughout."""
import threading
import time

import pytest

import nbdist

pytestmark = pytest.mark.timeout(120)

SLEEPERS = """
import time, threading
def wait_for_data():
    time.sleep(30)
def train_step():
    t = torch.ones(4)
    dist.all_reduce(t)
"""


def _last(stacks, rank):
    frames = stacks.frames(rank)
    return frames[-1][2] if frames else None


def test_stacks_of_an_idle_group_fold_into_one_line():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=30) as g:
        stacks = g.stacks()
        assert isinstance(stacks, nbdist.Stacks)
        assert stacks.summary() == "ranks 0, 1: idle (waiting for a request)"
        assert stacks.frames(0) == [] and set(stacks.by_rank) == {0, 1}


def test_answers_another_thread_already_read_are_not_waited_for():
    """Issue 34, risk 8: the reader of an idle group's channels (``Group.stacks()`` under the
    group's lock) counted only the answers it read itself. Answers a call had already read and
    posted -- that call ended just before the lock was taken -- made it wait its whole timeout."""
    from nbdist.runtime import stacks

    with nbdist.start(2, backend="gloo", device="cpu", timeout=30) as g:
        rs = g._rs
        n, asked = stacks.ask(rs, [0, 1])
        for _ in range(200):  # each call reads the channels, and posts the answers it finds
            g.run(int)
            if len(rs.stacks.answered(n, asked)) == 2:
                break
        assert rs.stacks.answered(n, asked) == [0, 1]
        got = {}
        reader = threading.Thread(target=lambda: got.update(stacks.collect(rs, n, asked, 120.0,
                                                                           read=True)))
        with g._lock:  # as Group.stacks() when the group is idle: it reads the channels itself
            reader.start()
            reader.join(60)
        assert not reader.is_alive(), "it waited for answers that had already come"
        assert sorted(got) == [0, 1] and got[0]["threads"][0]["main"]


def test_a_hung_collective_and_a_stuck_rank_are_seen_while_the_job_runs():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        g.exec(SLEEPERS)
        job = g.submit_exec("if rank == 1:\n    wait_for_data()\ntrain_step()")
        try:
            deadline = time.monotonic() + 20
            while True:  # until both ranks are inside the job's code
                stacks = g.stacks()
                if (_last(stacks, 0), _last(stacks, 1)) == ("all_reduce", "wait_for_data") or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert _last(stacks, 0) == "all_reduce", str(stacks)
            assert [f[2] for f in stacks.frames(0)][-3:-2] == ["train_step"]
            assert _last(stacks, 1) == "wait_for_data", str(stacks)
            summary = stacks.summary().splitlines()
            assert summary.pop(0) == "rank 1 never reached collective #1 (none before it); it " \
                f"is at {stacks.frames(1)[-1][0]}:{stacks.frames(1)[-1][1]} wait_for_data."
            assert summary[0].startswith("rank 0: <dist-cell-") and summary[0].endswith(
                "train_step -> c10d_logger.py:83 wrapper -> distributed_c10d.py:"
                f"{stacks.frames(0)[-1][1]} all_reduce")
            assert summary[1].startswith("rank 1: <dist-cell-") and \
                summary[1].endswith("wait_for_data")
            text = str(stacks)
            assert "--- rank 1 ---" in text and "time.sleep(30)" in text  # the source lines
            assert job.running()  # asking changed nothing
        finally:
            job.interrupt()
            job.wait(30)


def test_ranks_in_the_same_place_fold_and_every_thread_is_shown_on_request():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        g.exec(SLEEPERS + "loader = threading.Thread(target=wait_for_data, name='loader', "
                          "daemon=True)\nloader.start()")
        job = g.submit_exec("wait_for_data()")
        try:
            deadline = time.monotonic() + 20
            while _last(g.stacks(), 1) != "wait_for_data" and time.monotonic() < deadline:
                time.sleep(0.2)
            stacks = g.stacks()
            (line,) = stacks.summary().splitlines()
            assert line.startswith("ranks 0, 1: <dist-cell-") and line.endswith("wait_for_data")
            every = g.stacks(all_threads=True)
            names = [t["name"] for t in every.by_rank[0]["threads"]]
            assert names[0] == "MainThread" and "loader" in names
            assert not [n for n in names if n.startswith("nbdist-")]  # nbdist's own: left out
            assert "thread loader:" in str(every)
            assert list(g.stacks(ranks=[1]).by_rank) == [1]
        finally:
            job.interrupt()
            job.wait(30)


def test_a_blocking_call_is_seen_from_another_thread():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        g.exec(SLEEPERS)
        seen = []

        def look():
            time.sleep(2.0)  # the ranks are in the cell's sleep by then (it lasts 6 s)
            seen.append(g.stacks(timeout=10))

        looker = threading.Thread(target=look)
        looker.start()
        g.exec("time.sleep(6)")  # this thread reads the channels meanwhile
        looker.join(20)
        assert seen and seen[0].summary().startswith("ranks 0, 1: <dist-cell-"), seen


def test_a_timeout_error_carries_the_stacks_taken_before_the_kill():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        g.exec(SLEEPERS)
        with pytest.raises(nbdist.DistTimeoutError) as info:
            g.exec("if rank == 1:\n    wait_for_data()\ntrain_step()", timeout=3)
        err = info.value
        assert _last(err.stacks, 0) == "all_reduce" and _last(err.stacks, 1) == "wait_for_data"
        text = str(err)
        assert "ranks 0, 1 still running after 3 s;" in text
        # the recorder: rank 1 is not in the collective rank 0 waits in, and says where it is
        assert "\nWhere they were when the time ran out:\nrank 1 never reached collective #1 " \
               "(none before it); it is at <dist-cell-" in text
        assert "wait_for_data.\nrank 0: <dist-cell-" in text
        assert "all_reduce\nrank 1: <dist-cell-" in text and text.endswith("wait_for_data")


def test_mismatched_collectives_are_named():
    """The issue's case: rank 0 in all_reduce(ones(1024)), rank 1 in broadcast(ones(10))."""
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        g.exec("for _ in range(3):\n    dist.all_reduce(torch.ones(8))")
        recorded = g.stacks().by_rank[1]["collectives"]
        assert [e[:5] for e in recorded] == [[i, "all_reduce", "default", (8,), "float32"]
                                             for i in (1, 2, 3)]
        assert all(e[6] >= e[5] for e in recorded)  # returned
        with pytest.raises(nbdist.DistTimeoutError) as info:
            g.exec("if rank == 0:\n    dist.all_reduce(torch.ones(1024))\nelse:\n"
                   "    dist.broadcast(torch.ones(10), 0)", timeout=3)
        assert info.value.stacks.collectives() == [
            "mismatched collectives: rank 0 is in all_reduce #4 (1024 float32); rank 1 is in "
            "broadcast #4 (10 float32)."]
        assert "time ran out:\nmismatched collectives: rank 0 is in all_reduce #4" in \
            str(info.value)


def test_point_to_point_batches_still_take_dist_isend():
    """torch's P2POp accepts only its own isend/irecv (pipelines use it): they stay unwrapped."""
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60) as g:
        got = g.exec("peer = 1 - rank\nbuf = torch.zeros(3)\n"
                     "ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), peer),\n"
                     "       dist.P2POp(dist.irecv, buf, peer)]\n"
                     "for w in dist.batch_isend_irecv(ops):\n    w.wait()\nbuf.tolist()")
        assert got == [[1.0] * 3, [0.0] * 3]


def test_the_recorder_can_be_turned_off():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60,
                      env={"NBDIST_RECORD": "0"}) as g:
        g.exec("dist.all_reduce(torch.ones(8))")
        assert g.stacks().by_rank[0]["collectives"] == []
        assert g.exec("hasattr(dist.all_reduce, '_nbdist_recorded')") == [False, False]


def test_a_stopped_group_has_no_stacks_to_show():
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    g.stop()
    with pytest.raises(nbdist.GroupClosedError, match="this group is stopped: it has no running "
                                                      r"ranks to take stacks from; call restart\(\)"):
        g.stacks()


def test_a_stalled_job_says_where_its_ranks_are_and_nothing_is_killed():
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60, stall=2) as g:
        g.exec(SLEEPERS + "def short_wait():\n    time.sleep(8)")
        pids = g.run(__import__("os").getpid)
        job = g.submit_exec("if rank == 1:\n    short_wait()\ntrain_step()\nrank")
        deadline = time.monotonic() + 7
        while job.state != "stalled" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.state == "stalled", job.describe()
        text = job.describe()
        assert "no progress for" in text and "(nothing logged or printed, no collective " \
            "completed):\nrank 1 never reached collective #1 (none before it); it is at " \
            "<dist-cell-" in text, text
        assert _last(job.stalled, 0) == "all_reduce"
        assert job.wait(30) and job.result() == [0, 1]  # it went on: a stall kills nothing
        assert job.stalled is None and g.run(__import__("os").getpid) == pids


def test_collectives_completing_are_progress_even_when_nothing_is_printed():
    """Two looks at the ranks' collectives half the stall time (1.5 s) apart: ~100 all_reduces
    complete between them, so only a machine frozen for 1.5 s could call this job stalled."""
    with nbdist.start(2, backend="gloo", device="cpu", timeout=60, stall=3) as g:
        job = g.submit_exec("import time\nfor i in range(600):\n    dist.all_reduce(torch.ones(4))"
                            "\n    time.sleep(0.01)")
        seen = set()
        while not job.wait(0.1):
            seen.add(job.state)
        assert seen == {"running"} and job.state == "done"


def test_stall_must_be_a_positive_number_of_seconds():
    with pytest.raises(ValueError, match=r"stall must be a positive number of seconds, got 0"):
        nbdist.start(2, backend="gloo", device="cpu", stall=0)
