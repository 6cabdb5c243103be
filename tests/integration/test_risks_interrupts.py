"""Ctrl-C in the caller at several points of a call and of a submit (issue 25, risks 1 and 8).

Each test delivers a real SIGINT to this process's main thread -- what the notebook's interrupt
button sends to the kernel -- at one named point, by wrapping the function that runs there. Whatever
the point, the group ends usable (it answers an all_reduce) or clearly broken, with ``restart()``
bringing it back: never "busy" with nothing running, never holding a job that cannot end.
"""
import os
import signal
import threading
import time

import pytest

import nbdist
from nbdist.runtime import calls, jobs, output
from nbdist.wire import transport

# tests/integration, on sys.path
from threaded import ctrl_c_elsewhere

pytestmark = pytest.mark.timeout(120)

ALL_REDUCE = "t = torch.ones(1); dist.all_reduce(t); t.item()"
BIG = 1 << 20  #: bytes a request carries here: a closure that large goes in two sendall()s


def ctrl_c():
    """SIGINT to the main thread, taken right here: the sleep is what it interrupts."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    time.sleep(30)
    raise AssertionError("the SIGINT did not interrupt the caller")


def interrupt_in(monkeypatch, owner, name, nth=1, when=lambda *a, **k: True):
    """Ctrl-C at the ``nth`` call of ``owner.name`` for which ``when(*args)`` holds, before it
    runs; the other calls run as usual. Returns the list of calls seen (for asserts)."""
    real = getattr(owner, name)
    seen = []

    def wrapped(*args, **kwargs):
        if when(*args, **kwargs):
            seen.append(args)
            if len(seen) == nth:
                ctrl_c()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    return seen


class _CutSocket:
    """A channel's socket whose next large ``sendall`` sends half its bytes, then takes Ctrl-C."""

    def __init__(self, sock):
        self._sock = sock

    def sendall(self, data):
        if len(data) >= BIG:
            self._sock.sendall(data[:len(data) // 2])
            ctrl_c()
        return self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def interrupt_mid_send(monkeypatch):
    """Ctrl-C halfway through the first large request a channel sends (rank 0's)."""
    real = transport.Channel.send_bytes
    done = []

    def send_bytes(self, data):
        if done or len(data) < BIG:
            return real(self, data)
        done.append(True)
        sock, self.sock = self.sock, _CutSocket(self.sock)
        try:
            return real(self, data)
        finally:
            self.sock = sock

    monkeypatch.setattr(transport.Channel, "send_bytes", send_bytes)


def interrupted(fn, *args, **kwargs) -> nbdist.GroupInterrupted:
    """Call ``fn``, which must raise :class:`nbdist.GroupInterrupted`; return it. A bare
    KeyboardInterrupt fails the test (escaping, it would end the whole pytest run)."""
    try:
        fn(*args, **kwargs)
    except nbdist.GroupInterrupted as err:
        return err
    except KeyboardInterrupt:
        pytest.fail("a bare KeyboardInterrupt escaped nbdist")
    pytest.fail("the call was not interrupted")


def big_request():
    blob = b"x" * BIG

    def sized():
        return len(blob)

    return sized


def check_afterwards(g, usable):
    """The group is usable (``usable=True``: without a restart), or broken and restartable."""
    assert g.job is None, "a job that can never end holds the group"
    assert g.state == ("ready" if usable else "broken"), g.state
    assert g.status().state == g.state
    if not usable:
        with pytest.raises(nbdist.GroupClosedError, match="broken after an earlier failure"):
            g.run(os.getpid)
        g.restart()
    assert g.exec(ALL_REDUCE) == [2.0, 2.0]


# ---- submit: risk 1 ---------------------------------------------------------------------------
def test_ctrl_c_halfway_through_a_submit_s_request(group, monkeypatch):
    """Was: the job was recorded before its request was sent; after the interrupted send every
    call raised GroupBusyError for a job "running" forever, even after restart()."""
    interrupt_mid_send(monkeypatch)
    err = interrupted(group.submit, big_request())
    assert "rank 0 was killed: the interrupt came while its request was half sent" in str(err)
    assert "call restart() to bring it back" in str(err)
    assert err.killed == [0]
    monkeypatch.undo()
    check_afterwards(group, usable=False)


def test_ctrl_c_between_two_ranks_requests_of_a_submit(group, monkeypatch):
    interrupt_in(monkeypatch, transport.Channel, "send_bytes", nth=2,
                 when=lambda self, data: len(data) >= BIG)  # rank 1's, rank 0 has its own
    err = interrupted(group.submit, big_request())
    assert "stopped on SIGINT; the group is still usable" in str(err) and err.killed == []
    monkeypatch.undo()
    check_afterwards(group, usable=True)


def test_ctrl_c_as_a_submitted_job_s_thread_starts(group, monkeypatch):
    interrupt_in(monkeypatch, jobs.Job, "start")
    err = interrupted(group.submit, time.sleep, 30)
    assert "as background job 'sleep' started: its request had reached the ranks" in str(err)
    job = jobs.STARTED[-1]
    assert job.name == "sleep" and job.wait(30)
    assert job.state == "interrupted"  # stopped as job.interrupt() stops it
    # Was: the interrupt, sent at once, often reached the ranks before their request's code had
    # started; they dropped it, slept on and were killed after the grace period.
    assert isinstance(job.error, nbdist.GroupInterrupted) and job.error.killed == []
    monkeypatch.undo()
    check_afterwards(group, usable=True)


@pytest.mark.timeout(180)
def test_a_real_ctrl_c_during_a_large_submit(group):
    """The issue's reproduction: SIGINT from a timer while a large closure is being sent (256 MiB
    here). Wherever it lands -- in the send, after it, or after submit returned -- no job is left
    that cannot end, and the group is usable or restartable."""
    blob = b"x" * (256 << 20)

    def sized():
        return len(blob)

    submitted = threading.Event()

    def fire_when_busy():  # as the send starts, or at once if it was over before this looked
        while group.state != "busy" and not submitted.is_set():
            time.sleep(0.001)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    timer = threading.Thread(target=fire_when_busy)
    timer.start()
    job = None
    try:
        job = group.submit(sized)
        submitted.set()
        time.sleep(30)  # the SIGINT lands here if the send was over before it came
    except (KeyboardInterrupt, nbdist.GroupInterrupted):
        pass
    finally:
        submitted.set()
        timer.join()
    del blob
    running = group.job or job
    if running is not None:
        assert running.wait(60)
    assert group.state in ("ready", "broken")
    check_afterwards(group, usable=group.state == "ready")


# ---- an interrupt that overtakes its request ------------------------------------------------
def test_ctrl_c_just_after_a_call_s_requests_were_sent(group, monkeypatch):
    """The interrupt goes down each rank's lifeline, the request down its channel: a rank may read
    the interrupt before its request's code starts. Was: it dropped it, ran on, and was killed."""
    group.push(keep=5)
    real, sent = transport.Channel.send_bytes, []

    def send_bytes(self, data):
        real(self, data)
        sent.append(self)
        if len(sent) == 2:  # both ranks have their request
            ctrl_c()

    monkeypatch.setattr(transport.Channel, "send_bytes", send_bytes)
    err = interrupted(group.run, time.sleep, 30)
    monkeypatch.undo()
    assert "stopped on SIGINT; the group is still usable" in str(err), str(err)
    assert err.killed == [] and err.interrupted == [0, 1], (str(err), err.interrupted)
    check_afterwards(group, usable=True)
    assert group.pull("keep") == [5, 5]


def test_an_interrupt_read_before_its_request_stops_the_code_as_it_starts(group):
    """The same race made certain: each rank reads the interrupt of the next request first."""
    seq = next(group._seq) + 1  # the next call's sequence number
    for r in (0, 1):
        assert group._rs.interrupt(r, seq)
    time.sleep(0.5)  # the watchdogs have read it long before the request comes
    with pytest.raises(nbdist.RemoteError, match="KeyboardInterrupt"):
        group.run(time.sleep, 30)
    check_afterwards(group, usable=True)
    assert group.run(int, "7") == [7, 7]  # a later request is not interrupted


# ---- blocking calls: risk 8 -------------------------------------------------------------------
def test_ctrl_c_halfway_through_a_call_s_request(group, monkeypatch):
    interrupt_mid_send(monkeypatch)
    err = interrupted(group.run, big_request())
    assert "rank 0 was killed: the interrupt came while its request was half sent" in str(err)
    monkeypatch.undo()
    check_afterwards(group, usable=False)


@pytest.mark.parametrize("rank", [0, 1])
def test_ctrl_c_while_a_result_is_unpickled_keeps_the_group(group, monkeypatch, rank):
    """Was: the group was torn down and the ranks' variables lost, though the ranks had replied."""
    group.push(keep=42)
    interrupt_in(monkeypatch, calls.serialize, "loads", nth=rank + 1)
    def seven():
        return 7

    err = interrupted(group.run, seven)
    text = str(err)
    assert "interrupted while the results of 'run " in text, text
    assert "seven' were unpickled here" in text, text
    assert "this call's results are lost" in text and "the group is still usable" in text
    assert err.killed == [] and err.interrupted == []
    monkeypatch.undo()
    check_afterwards(group, usable=True)
    assert group.pull("keep") == [42, 42]


def test_ctrl_c_while_a_call_s_output_is_shown(group, monkeypatch):
    """Was: a Ctrl-C in the end of a call (showing its output) left the group "busy"."""
    group.push(keep=1)
    interrupt_in(monkeypatch, output.RankOutput, "finish")
    err = interrupted(group.exec, "print('hello')")
    assert "interrupted while the output of 'exec' was shown" in str(err)
    monkeypatch.undo()
    check_afterwards(group, usable=True)
    assert group.pull("keep") == [1, 1]


def test_ctrl_c_while_a_death_is_reported(group, monkeypatch):
    interrupt_in(monkeypatch, calls, "_deaths")
    with pytest.raises(KeyboardInterrupt):
        group.exec("import os, time\nif rank == 1: os._exit(3)\ntime.sleep(30)")
    monkeypatch.undo()
    check_afterwards(group, usable=False)


# ---- a SIGINT the OS hands to another thread --------------------------------------------------
def test_a_ctrl_c_another_thread_received_stops_a_blocking_call(group, tmp_path):
    """Was: the caller slept on in select() until the ranks replied -- here when the nap ended;
    in the suite, test_attach's interrupt took the whole 60 s nap 3 runs in 17."""
    started = tmp_path / "started"
    group.push(napped=False)
    with ctrl_c_elsewhere(0.5, ready=started.exists):
        err = interrupted(group.exec, f"import time\nopen({str(started)!r}, 'a').close()\n"
                                      "time.sleep(60)\nnapped = True")
    assert "stopped on SIGINT; the group is still usable" in str(err), str(err)
    assert group.pull("napped") == [False, False]  # the nap was cut short, not waited out
    check_afterwards(group, usable=True)


def test_a_ctrl_c_another_thread_received_stops_the_wait_for_a_blocked_sink():
    """A sink that blocks holds the end of the call; Ctrl-C ends that wait (the call's results
    are lost, the group is kept) even when the OS gave the SIGINT to another thread."""
    entered, release, released_late = threading.Event(), threading.Event(), []

    def sink(rank, stream, text):
        entered.set()
        if not release.wait(60):
            released_late.append(rank)

    with nbdist.start(2, output=sink) as g:
        try:
            with ctrl_c_elsewhere(0.5, ready=entered.is_set):
                err = interrupted(g.exec, "print('held')")
        finally:
            release.set()
        assert "interrupted while the output of 'exec' was shown" in str(err), str(err)
        assert not released_late  # the wait ended before the sink gave up
        check_afterwards(g, usable=True)


def test_a_ctrl_c_another_thread_received_stops_the_read_of_a_stalled_message(monkeypatch):
    """A peer that sent part of a message and stopped is given up after the channel's stall bound
    (30 s); a Ctrl-C meanwhile ends the read at once, wherever the OS delivered it."""
    import socket
    import struct

    waiting, readable = threading.Event(), transport._readable

    def noted(sock, timeout):  # the read has reached its wait for the rest
        waiting.set()
        return readable(sock, timeout)

    monkeypatch.setattr(transport, "_readable", noted)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    try:
        channel = transport.Channel(ours)
        assert channel.stall == transport.MESSAGE_STALL == 30.0
        theirs.sendall(struct.pack("!Q", 100) + b"x" * 40)  # 40 of 100 bytes, then nothing
        started = time.monotonic()
        with ctrl_c_elsewhere(0.5, ready=waiting.is_set):
            with pytest.raises(KeyboardInterrupt):
                channel.recv_bytes()
        assert time.monotonic() - started < transport.MESSAGE_STALL / 2  # not the stall's bound
    finally:
        ours.close()
        theirs.close()
