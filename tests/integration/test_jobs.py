"""Background jobs and metrics from the ranks, on real groups (issue 17)."""
import os
import time

import pytest

import nbdist

pytestmark = pytest.mark.timeout(120)


def _train(steps, pause=0.02):
    import time

    import torch
    import torch.distributed as dist

    import nbdist

    for i in range(steps):
        t = torch.ones(1)
        dist.all_reduce(t)
        nbdist.log(step=i, loss=1.0 / (i + 1), world=t.sum())
        time.sleep(pause)
    return dist.get_rank()


def _wait_until(cond, limit=30.0):
    deadline = time.monotonic() + limit
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_submit_returns_at_once_and_metrics_stream_while_it_runs(group):
    job = group.submit(_train, 150)
    assert job.running() and not job.done() and job.state == "running"
    assert _wait_until(lambda: len(job.metrics) >= 8)
    seen_while_running = len(job.metrics)
    assert job.running(), "the job finished before its metrics were seen: make it longer"
    assert "job '_train': running" in str(group.status())
    assert group.job is job
    assert job.result(timeout=60) == [0, 1]
    assert job.state == "done" and group.job is None and group.state == "ready"
    assert len(job.metrics) == 2 * 150 * 2 > seen_while_running
    last = job.metrics.last()
    assert last[0]["loss"] == (149, pytest.approx(1 / 150)) and last[1]["world"] == (149, 2.0)
    df = job.metrics.to_pandas()
    assert list(df.columns) == ["rank", "step", "name", "value", "time_s"]
    assert job.metrics.to_csv().splitlines()[0] == "rank,step,name,value,time_s"
    assert "rank 1 step 149" in repr(job) and "nbdist job" in job._repr_html_()


def test_a_busy_group_refuses_calls_with_the_job_named(group):
    job = group.submit(time.sleep, 3)
    with pytest.raises(nbdist.GroupBusyError, match=r"busy with background job 'sleep' .*"
                                                   r"job\.wait\(\) or %dist_wait.*job\.interrupt"):
        group.run(os.getpid)
    with pytest.raises(nbdist.GroupBusyError):
        group.submit(os.getpid)
    assert job.result(timeout=30) == [None, None]
    assert len(set(group.run(os.getpid))) == 2


def test_result_raises_what_a_blocking_call_would(group):
    def boom():
        raise ValueError("bad batch")

    job = group.submit(boom)
    with pytest.raises(nbdist.RemoteError, match="ValueError on ranks 0, 1: bad batch"):
        job.result(timeout=30)
    assert job.state == "failed" and isinstance(job.error, nbdist.RemoteError)
    assert group.run(lambda: 1) == [1, 1]
    job = group.submit_exec("import time\ntime.sleep(30)", timeout=0.5, name="slow")
    with pytest.raises(nbdist.DistTimeoutError, match="still running after 0.5 s"):
        job.result(timeout=30)
    assert group.run(lambda: 2) == [2, 2]
    job = group.submit_exec("import os\nif rank == 1: os._exit(5)\nimport time; time.sleep(5)")
    with pytest.raises(nbdist.RankDiedError, match="rank 1 exited with code 5"):
        job.result(timeout=30)
    group.restart()
    with pytest.raises(TimeoutError, match="still running after 0.1 s; wait longer, or stop it"):
        group.submit(time.sleep, 2).result(timeout=0.1)
    group.job.wait(30)


def test_interrupt_stops_a_job_like_ctrl_c(group):
    job = group.submit(_train, 100000, 0.01)
    assert _wait_until(lambda: len(job.metrics) > 0)
    job.interrupt()
    assert job.wait(30)
    with pytest.raises(nbdist.GroupInterrupted):
        job.result()
    assert job.state == "interrupted"
    if group.state == "broken":  # a rank was blocked in the all_reduce when SIGINT came
        group.restart()
    assert group.run(lambda: 3) == [3, 3]


def test_interrupt_kills_ranks_stuck_in_a_collective_and_says_so():
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30, grace=0.3)
    try:
        job = g.submit_exec("import time, torch\nif rank == 0:\n    time.sleep(60)\n"
                            "dist.barrier()")
        time.sleep(0.5)
        job.interrupt()
        assert job.wait(30)
        with pytest.raises(nbdist.GroupInterrupted, match="call restart"):
            job.result()
        assert g.state == "broken"
        g.restart()
        assert g.run(lambda: 4) == [4, 4]
    finally:
        g.stop()


def test_stop_interrupts_a_running_job_first():
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    job = g.submit(time.sleep, 60)
    g.stop()
    assert job.done() and job.state in ("interrupted", "failed")
    assert g.state == "stopped"


def test_restart_interrupts_a_running_job_first_and_the_new_ranks_stay():
    """restart() with a job running (the launcher's Restart button calls it): the job is
    interrupted as by stop(), and its end never tears down the ranks the restart started."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    try:
        old = g.run(os.getpid)
        job = g.submit_exec("import time\nt = torch.ones(1)\nif rank == 0:\n"
                            "    time.sleep(60)\ndist.all_reduce(t)", name="stuck")
        time.sleep(0.5)
        g.restart()
        assert job.done() and job.state in ("interrupted", "failed")
        with pytest.raises(nbdist.GroupInterrupted):
            job.result(timeout=5)
        new = g.run(os.getpid)
        assert g.state == "ready" and set(new).isdisjoint(old)
        time.sleep(0.5)  # the job's end is long past: nothing of it touches the new ranks
        assert g.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]
    finally:
        g.stop()


def test_job_output_is_kept_per_rank(group):
    job = group.submit_exec("for i in range(3):\n    print(f'line {i} on {rank}')", name="out")
    job.result(timeout=30)
    assert job.output[0] == ["line 0 on 0", "line 1 on 0", "line 2 on 0"]
    assert job.output[1][-1] == "line 2 on 1"


def test_log_in_a_blocking_call_and_its_errors(group):
    group.run(_train, 3, 0.0)
    assert len(group.metrics) == 12
    with pytest.raises(nbdist.RemoteError, match=r"nbdist.log\(x=\.\.\.\) takes a number or a "
                                                 r"0-d tensor, got str"):
        group.exec("import nbdist\nnbdist.log(x='high')")
    with pytest.raises(RuntimeError, match="records metrics on a rank of an nbdist group"):
        nbdist.log(step=1, loss=0.5)


def _steps_with_a_slow_rank(steps):
    import time

    import torch
    import torch.distributed as dist

    import nbdist

    t = torch.ones(1 << 16)
    for i in range(steps):
        with nbdist.step(i):
            time.sleep(0.03 if dist.get_rank() == 1 else 0.01)  # rank 1 computes 3x longer
            dist.all_reduce(t)


def test_a_rank_logging_faster_than_it_flushes_sends_itself_and_loses_nothing(group):
    def burst(n):
        import nbdist
        from nbdist.runtime import ranklog

        ranklog.MAX_BUFFER = 1000
        for i in range(n):
            nbdist.log(step=i, x=i)
        return len(ranklog._buffer)

    job = group.submit(burst, 25_000)
    assert all(left < 1000 for left in job.result(timeout=60))
    assert len(job.metrics) == 50_000 and job.metrics.dropped == 0


def test_step_breakdown_and_the_straggler_is_named(group):
    job = group.submit(_steps_with_a_slow_rank, 12)
    job.result(timeout=60)
    rows = list(job.metrics)
    assert {r["name"] for r in rows} == {"step_s", "comm_s", "compute_s"}
    last = job.metrics.last()
    for rank in (0, 1):
        step_s, comm_s, compute_s = (last[rank][k][1] for k in ("step_s", "comm_s", "compute_s"))
        assert comm_s > 0 and compute_s > 0 and abs(step_s - comm_s - compute_s) < 1e-9
    # rank 0 waits in the all_reduce for rank 1: its communication time holds that wait
    assert last[1]["compute_s"][1] >= 0.03
    slow = job.metrics.stragglers()
    assert list(slow) == [1] and slow[1] >= 1.25
    assert "straggler: rank 1 (compute" in job.describe()


def _on_this_rank(n):
    import os

    import torch.distributed as dist

    import nbdist

    rank = dist.get_rank()
    for i in range(n):
        nbdist.log(step=i, x=float(rank))
    print(f"ran on {rank}")
    return rank, os.getpid()


def test_a_job_on_some_ranks_runs_there_only_and_returns_their_values(group):
    pids = group.run(os.getpid)
    job = group.submit(_on_this_rank, 3, ranks=[1])
    assert job.result(timeout=30) == [(1, pids[1])]  # one value: rank 1's
    assert {r["rank"] for r in job.metrics} == {1} and len(job.metrics) == 3
    assert job.output.get(0, []) == [] and job.output[1] == ["ran on 1"]
    assert group.state == "ready" and group.run(lambda: 6) == [6, 6]


def test_elapsed_grows_while_the_job_runs_and_stops_when_it_ends(group):
    job = group.submit(time.sleep, 2.0)
    first = job.elapsed
    time.sleep(0.3)
    second = job.elapsed
    assert job.running(), "the job ended too soon to see its time grow"
    assert 0 <= first < second
    assert job.wait(30)
    final = job.elapsed
    assert final >= 2.0  # the job started (kernel side) before the ranks slept 2 s
    assert final == job.ended - job.started
    time.sleep(0.3)
    assert job.elapsed == final
