"""Lifecycle risks of issue 34 (5, 6, 7 and teardown within its budget), each forced with real
groups, real threads and hooks at the exact point of the race -- never sleep-and-hope."""
import os
import signal
import sys
import threading
import time

import pytest

import nbdist
from threaded import LIVENESS, in_thread  # tests/integration, on sys.path
from nbdist.runtime import calls, jobs
from nbdist.runtime import group as group_module

pytestmark = pytest.mark.timeout(180)

# ---- risk 7: the job thread and stop() never use one rank set at once ---------------------------
def test_stop_never_shuts_the_ranks_down_under_the_job_thread_that_reads_them(monkeypatch):
    """Was: when job.end() timed out, stop() closed the ranks' channels and selector and released
    their processes while the job's thread still polled them, without any lock. The job's thread
    is held inside its poll while stop() runs; when it goes on, what it reads must still be open,
    and it reaps the ranks itself."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    try:
        job = g.submit(time.sleep, 60)
        rs = g._rs
        inside, resume, seen = threading.Event(), threading.Event(), {}
        poll = calls.Call.poll

        def held_poll(self, ranks, timeout):
            if self is job.call and not inside.is_set():
                inside.set()
                resume.wait(LIVENESS)
                seen["open"] = [r.channel.sock.fileno() != -1 for r in ranks.ranks]
                seen["selector"] = ranks._sel.get_map() is not None
            return poll(self, ranks, timeout)

        monkeypatch.setattr(calls.Call, "poll", held_poll)
        monkeypatch.setattr(jobs.Job, "end", lambda self, timeout: None)  # its wait timed out
        monkeypatch.setattr(group_module, "STOP_WAIT", 1.0)  # the budget: 1 s
        assert inside.wait(LIVENESS)
        stopper, box = in_thread(g.stop, timeout=1)
        stopper.join(LIVENESS)
        resume.set()
        assert not stopper.is_alive()
        assert g.state == "stopped"
        assert job.wait(LIVENESS)
        assert seen == {"open": [True, True], "selector": True}, seen
        err = box.get("error")
        assert isinstance(err, nbdist.DistTimeoutError), box
        assert str(err).startswith("the group is stopped, but ranks 0, 1 could not be confirmed "
                                   "gone within 1 s: rank 0: its thread (a background job "
                                   "waiting for its ranks) still reads them; that thread reaps "
                                   "them when it ends;")
        assert err.ranks == [0, 1]
        with pytest.raises(nbdist.GroupClosedError, match="stopped while job 'sleep' ran"):
            job.result()
        assert all(r.process.exit_status is not None for r in rs.ranks)  # reaped by the job
        assert all(r.channel.sock.fileno() == -1 for r in rs.ranks) and not rs.orphaned
    finally:
        resume.set()
        monkeypatch.undo()
        g.stop()


# ---- risk 6: a pdb prompt never holds up a stop, nor opens in the middle of a teardown ----------
def test_a_breakpoint_reached_while_a_timed_out_call_is_ended_quits_instead_of_prompting(
        monkeypatch):
    """Was: a rank that reached breakpoint() while its call was being ended (here: its
    KeyboardInterrupt handler, after the timeout) opened a prompt in the notebook in the middle of
    the teardown, the group's lock held until someone answered."""
    prompts = []
    monkeypatch.setattr("builtins.input", lambda text="": prompts.append(text) or "c")
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    try:
        with pytest.raises(nbdist.DistTimeoutError) as info:
            g.exec("import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
                   "    if rank == 1:\n        breakpoint()\n    raise", timeout=1)
        assert prompts == [], "a pdb prompt opened while the call was being ended"
        assert "stopped on SIGINT" in str(info.value)  # pdb quit (q): the rank went on
        assert g.run(lambda: 2) == [2, 2]
    finally:
        g.stop()


class _Stdin:
    """The kernel's stdin, read by pdb's prompt: a real pipe; says when a read begins."""

    def __init__(self, fd):
        self._file = os.fdopen(fd, "r")
        self.reading = threading.Event()

    def readline(self, *args):
        self.reading.set()
        return self._file.readline(*args)

    def __getattr__(self, name):
        return getattr(self._file, name)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX: a real SIGINT ends the "
                    "prompt's read (Windows' kernel input() polls for the interrupt instead)")
def test_stop_from_another_thread_ends_a_pdb_prompt_that_waits_for_the_user(monkeypatch):
    """Was: the prompt read the kernel's stdin holding the group's lock, so stop(timeout) from
    another thread killed the ranks, waited, and raised GroupBusyError -- the group stopped
    only once someone answered the prompt."""
    read, write = os.pipe()
    stdin = _Stdin(read)
    monkeypatch.setattr(sys, "stdin", stdin)  # a user who never answers: a read that waits

    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)

    def stop_once_prompting():
        stdin.reading.wait(LIVENESS)
        try:  # (a bound for a loaded machine: without the fix no timeout is enough, the prompt
            return g.stop(timeout=15)  # waits for the user; with it the stop returns once done)
        finally:
            os.write(write, b"c\n")  # answers a prompt still open (so a failure cannot hang)

    stopper, box = in_thread(stop_once_prompting)
    try:
        with pytest.raises(nbdist.GroupClosedError, match=r"stopped \(stop\(\) from another "
                                                          r"thread\) while 'exec'"):
            g.exec("if rank == 1:\n    breakpoint()\n1")
        stopper.join(LIVENESS)
        assert not stopper.is_alive() and box == {"value": None}, box
        assert g.state == "stopped"
    finally:
        stopper.join(LIVENESS)
        g.stop()
        stdin.close()
        os.close(write)


# ---- teardown within its budget ------------------------------------------------------------------
#: a hang guard for stop(timeout=5), not a speed target: the stop itself is bounded by about 6 s
#: (the figures are in the issue's report); a loaded machine adds scheduling delay on top
STOP_GUARD = 20.0


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "job"])
def test_stop_all_with_unreachable_ranks_returns_in_time_and_says_what_it_left(
        tmp_path, capsys, busy):
    """Was: stopping a group whose ranks do not answer (their host stopped: SIGSTOP, no FIN, no
    reply) waited on clocks of its own -- 2 s per drain, per dead rank, the generations' close,
    job.end(grace + 10) before the stop's time started -- about 8 s here, 20 s with more ranks,
    and said nothing about the ranks it gave up on; stop_all() at exit swallowed any error."""
    from attach_helpers import Cluster, kill_tree

    c = Cluster(tmp_path, nnodes=2, nproc=1)
    g = c.group
    pids = [r.pid for r in g.status().ranks]
    try:
        if busy:
            job = g.submit(time.sleep, 600)
            while not all(r.state == "busy" for r in g.status().ranks):
                time.sleep(0.01)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # unreachable from here on
        began = time.monotonic()
        nbdist.stop_all()  # stop(timeout=5) for every group, as at interpreter exit
        took = time.monotonic() - began
        assert took < STOP_GUARD, f"stop(timeout=5) took {took:.1f} s"
        assert g.state == "stopped"
        err = capsys.readouterr().err
        said = f"nbdist: stopping group {g.id}: DistTimeoutError: the group is stopped, but "
        assert said in err and "could not be confirmed gone within 5 s: rank " in err and \
            ": it did not end within the time left (its host does not answer?)" in err, err
        if busy:
            assert job.wait(LIVENESS) and job.state in ("failed", "interrupted")
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in c.nodes:
            kill_tree(p)
            p.stderr.close()


def test_stop_gives_up_within_its_time_on_a_call_that_does_not_end(monkeypatch):
    """A call that does not end when its ranks are killed (its thread held where it reads them;
    as a call waiting on ranks whose host stopped answering) holds the group past the stop's
    time: stop(timeout) still returns within it, saying what holds the group; the call ends as
    stopped once it goes on."""
    g = nbdist.start(2, backend="gloo", device="cpu", timeout=30)
    inside, resume = threading.Event(), threading.Event()
    poll = calls.Call.poll

    def held_poll(self, ranks, timeout):
        if self.what == "exec" and not inside.is_set():
            inside.set()
            resume.wait(LIVENESS)
        return poll(self, ranks, timeout)

    monkeypatch.setattr(calls.Call, "poll", held_poll)
    monkeypatch.setattr(group_module, "STOP_WAIT", 1.0)  # the budget: 1 s
    caller, box = in_thread(g.exec, "import time\ntime.sleep(60)")
    try:
        assert inside.wait(LIVENESS)
        with pytest.raises(nbdist.GroupBusyError) as info:
            g.stop(timeout=1)
        assert str(info.value) == (
            "stop(timeout=1) could not stop the group: another thread still holds it 1 s later "
            "(running 'exec', whose ranks were killed). The stop is recorded: that thread stops "
            "the group as soon as it is done; call stop() again to wait for it.")
    finally:
        resume.set()
        caller.join(LIVENESS)
    assert isinstance(box.get("error"), nbdist.GroupClosedError), box
    assert g.state == "stopped"
