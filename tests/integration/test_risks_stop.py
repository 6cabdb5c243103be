"""stop() and status() from other threads, jobs that outlive a stop, and a slow output sink
(issue 25, risks 4, 6 and 7, and the sink on the relay thread): real groups, real threads."""
import os
import signal
import sys
import threading
import time

import pytest

import nbdist
from threaded import LIVENESS, in_thread  # tests/integration, on sys.path
from nbdist.runtime import jobs
from nbdist.runtime.processes import LocalProcess

from attach_helpers import Cluster

pytestmark = pytest.mark.timeout(120)

ALL_REDUCE = "t = torch.ones(1); dist.all_reduce(t); t.item()"
# ---- risk 4: a job settles against a stopped group ---------------------------------------------
@pytest.mark.parametrize("how, state, text", [
    ("stop", "stopped", "stopped while job 'sleep' ran; its ranks were stopped with it"),
    ("restart", "ready", "restarted while job 'sleep' ran; its ranks were replaced")])
def test_a_job_still_running_after_stop_gave_up_on_it_ends_against_the_right_group(
        monkeypatch, how, state, text):
    """Was: stop() went on after Job.end timed out; when the job's thread then settled its call
    against the stopped group, settle() crashed on the missing ranks and the group said "broken"."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    try:
        job = g.submit(time.sleep, 60)
        monkeypatch.setattr(jobs.Job, "end", lambda self, timeout: None)  # its wait timed out
        getattr(g, how)()
        assert job.wait(LIVENESS)
        assert g.state == state
        with pytest.raises(nbdist.GroupClosedError, match="the group was " + text):
            job.result()
        monkeypatch.undo()
        if how == "stop":
            g.restart()  # a stopped local group can be started again
        assert g.exec(ALL_REDUCE) == [2.0, 2.0]
    finally:
        g.stop()


# ---- risk 6: stop() never gives up silently ----------------------------------------------------
@pytest.mark.timeout(300)
def test_stop_from_another_thread_while_the_next_generation_is_awaited(tmp_path):
    """Was: with the caller's thread inside the wait for torchrun's next generation (holding the
    group), stop(timeout) returned after 5 s with the group not stopped and still listening."""
    c = Cluster(tmp_path, nnodes=2, nproc=1, max_restarts=1, join_timeout=90)
    g = c.group
    try:
        workers = [r.pid for r in g.status().ranks]
        for p in c.nodes:  # the whole job goes: nothing will restart
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(nbdist.RankDiedError):
            g.run(lambda: 1)
        waiting, box = in_thread(g.run, lambda: 1)  # waits for generation 2, holding the group
        deadline = time.monotonic() + 30
        while g._lock.acquire(blocking=False) and time.monotonic() < deadline:
            g._lock.release()
            time.sleep(0.01)
        g.stop(timeout=0.5)
        assert g.state == "stopped"
        assert g._launcher.regen is None  # the launcher closed: no generation is admitted now
        waiting.join(LIVENESS)
        assert not waiting.is_alive()
        assert isinstance(box.get("error"), nbdist.GroupClosedError), box
        assert "stopped (stop() from another thread) while it was starting ranks" in \
            str(box["error"])
    finally:
        c.close(wait=5)


def _slowpoke(marker):
    """A backend whose rank 1 creates ``marker``, then never reaches the rendezvous."""
    ns = {"__name__": "__main__"}
    exec("import time, torch.distributed as dist\n"
         "def create(store, rank, size, timeout):\n"
         f"    if rank == 1:\n        open({str(marker)!r}, 'w').close()\n"
         "        time.sleep(600)\n"
         "    return dist.ProcessGroupGloo(store, rank, size, timeout)\n", ns)
    return ns["create"]


@pytest.mark.timeout(180)
def test_stop_that_cannot_stop_the_group_says_so_and_the_group_stops_later(tmp_path):
    """A start that outlasts stop()'s wait (a rank stuck before its rendezvous): stop raises an
    error that says what it could not do, and the starting thread stops the group when it ends."""
    marker = tmp_path / "rank1-stuck"
    nbdist.register_backend("slowpoke", _slowpoke(marker), devices=["cpu"], replace=True)
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    try:
        starting, box = in_thread(g.restart, backend="slowpoke", init_timeout=12)
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the new ranks are starting, rank 1 is stuck
        with pytest.raises(nbdist.GroupBusyError) as info:
            g.stop(timeout=0.2)
        text = str(info.value)
        assert text.startswith("stop(timeout=0.2) could not stop the group: another thread "
                               "still holds it 5 s later (starting ranks). The stop "
                               "is recorded: that thread stops the group as soon as it is done"), \
            text
        starting.join(LIVENESS)
        assert not starting.is_alive()
        assert isinstance(box.get("error"), nbdist.GroupClosedError), box
        assert g.state == "stopped"
        g.stop()  # nothing left to do
    finally:
        nbdist.backends.unregister_backend("slowpoke")
        g.stop()


# ---- risk 7: status() while processes are released --------------------------------------------
def test_status_while_stop_releases_the_processes():
    """Was: status() on another thread checked that a rank still ran, then read its process handle,
    which stop() had released in between (AttributeError). The status thread is paused at exactly
    that point while stop() runs."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    paused, resume = threading.Event(), threading.Event()
    target = LocalProcess.exit_status.fget.__code__

    def tracer(frame, event, arg):
        if event != "call" or frame.f_code is not target or paused.is_set():
            return None
        lines = []

        def local(frame, event, arg):
            if event == "line":
                lines.append(frame.f_lineno)
                if len(lines) == 2:  # past "still running?": about to read the handle
                    paused.set()
                    resume.wait(LIVENESS)
            return local
        return local

    def status_paused_mid_read():
        sys.settrace(tracer)
        try:
            return str(g.status())
        finally:
            sys.settrace(None)

    poller, box = in_thread(status_paused_mid_read)
    try:
        assert paused.wait(LIVENESS)
        g.stop()  # reaps and releases every process meanwhile
    finally:
        resume.set()
        poller.join(LIVENESS)
    assert "error" not in box, repr(box.get("error"))
    assert box["value"].startswith("group: ")  # read as the stop went: rows may lag a step
    assert g.status().state == "stopped"


# ---- the output sink: never on the relay thread ------------------------------------------------
def test_a_death_is_reported_while_the_output_sink_blocks():
    """Was: the user's sink ran on the relay thread under the relay's lock, and the death report
    waits for that lock: a sink that blocks held the RankDiedError back for as long."""
    release = threading.Event()

    def sink(rank, stream, text):
        if "hold the sink" in text:
            release.wait(2 * LIVENESS)

    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30, output=sink)
    try:
        call, box = in_thread(g.exec, "import os, time\nif rank == 1:\n"
                              "    print('hold the sink', flush=True)\n    time.sleep(0.5)\n"
                              "    os._exit(3)\ntime.sleep(30)")
        call.join(LIVENESS)
        reported = not call.is_alive()
        release.set()
        call.join(LIVENESS)
        assert reported, "the death was not reported while the sink was blocked"
        assert isinstance(box.get("error"), nbdist.RankDiedError), box
        assert "rank 1 exited with code 3" in str(box["error"])
        g.restart()
        assert g.exec(ALL_REDUCE) == [2.0, 2.0]
    finally:
        release.set()
        g.stop()


def test_a_slow_sink_still_gets_a_call_s_output_before_its_value():
    lines = []

    def sink(rank, stream, text):
        time.sleep(0.05)
        lines.extend((rank, line) for line in text.splitlines())

    with nbdist.start(2, backend="gloo", device="cpu", timeout=30, output=sink) as g:
        for n in range(3):
            del lines[:]
            assert g.exec(f"for i in range(5): print('line', i, flush=True)\n{n}") == [n, n]
            assert sorted(lines) == [(r, f"line {i}") for r in (0, 1) for i in range(5)]
