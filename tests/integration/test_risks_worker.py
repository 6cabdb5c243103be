"""Interrupts that land on a rank outside the user's code (between the end of a call and the reply,
or in a burst around a call) never kill the rank: real ranks, real SIGINTs, a real gloo group."""
import os
import signal
import sys
import threading
import time

import cloudpickle
import pytest

import nbdist

pytestmark = pytest.mark.timeout(120)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this file


def _interrupt_when_nbdist_resumes(user_frames=1):
    """Runs on a rank, called by the user's function: SIGINT this rank's main thread at the first
    line of nbdist's code that runs once the innermost ``user_frames`` frames (this caller's) have
    returned or raised -- the worker putting its "ignore SIGINT" handler back, or reporting the
    result or the error: an interrupt landing in that window."""
    main = threading.main_thread().ident
    user = []
    frame = sys._getframe(1)
    for _ in range(user_frames):
        user.append(frame)
        frame = frame.f_back
    nbdist_frames = []
    while frame is not None:
        nbdist_frames.append(frame)
        frame = frame.f_back

    def tracer(frame, event, arg):
        if event == "line" and not any(frame is f for f in user):
            sys.settrace(None)
            for f in nbdist_frames:
                f.f_trace = None
            signal.pthread_kill(main, signal.SIGINT)
            return None
        return tracer

    for f in nbdist_frames:
        f.f_trace_lines = True
        f.f_trace = tracer
    sys.settrace(tracer)  # tracing on for this thread; only frames outside the user's fire


def _interrupt_after_return(value):
    _interrupt_when_nbdist_resumes()
    return value


def _interrupt_after_raise():
    _interrupt_when_nbdist_resumes()
    raise ValueError("the call's own error")


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def _pids(g):
    return [r.pid for r in g.status().ranks]


def _stray_interrupt_while_idle(pids):
    """SIGINT every rank while it waits for the next request (as Jupyter's interrupt button does
    to the kernel's whole process group); give the signal time to be handled."""
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)


def test_interrupt_landing_as_a_call_ends_leaves_the_rank_serving(group):
    pids = _pids(group)
    try:
        out = group.run(_interrupt_after_return, 7)
    except nbdist.RemoteError as err:  # the interrupt may count as the call's: that is fine
        assert {f.type_name for f in err.failures.values()} == {"KeyboardInterrupt"}
    else:
        assert out == [7, 7]
    _stray_interrupt_while_idle(pids)
    assert group.run(_rank) == [0, 1]
    assert _pids(group) == pids and group.state == "ready"


def test_interrupt_landing_as_a_failing_call_ends_leaves_the_rank_serving(group):
    pids = _pids(group)
    with pytest.raises(nbdist.RemoteError) as info:
        group.run(_interrupt_after_raise)
    assert {f.type_name for f in info.value.failures.values()} <= {"ValueError",
                                                                  "KeyboardInterrupt"}
    _stray_interrupt_while_idle(pids)
    assert group.run(_rank) == [0, 1]
    assert _pids(group) == pids and group.state == "ready"


def test_a_burst_of_interrupts_around_many_calls_leaves_every_rank_serving(group):
    """SIGINTs as fast as this process can send them, while calls come and go: each call either
    returns or reports KeyboardInterrupt, and once the burst is over the group answers."""
    pids = _pids(group)
    stop = threading.Event()
    sent = [0]

    def burst():
        try:
            while not stop.is_set():
                for pid in pids:
                    os.kill(pid, signal.SIGINT)
                sent[0] += 1
        except ProcessLookupError:
            pass  # a rank died: the calls below report it

    thread = threading.Thread(target=burst)
    thread.start()
    seen = set()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                group.run(_rank)
                seen.add("ok")
            except nbdist.RemoteError as err:
                assert {f.type_name for f in err.failures.values()} == {"KeyboardInterrupt"}, err
                seen.add("interrupted")
    finally:
        stop.set()
        thread.join()
    assert sent[0] > 1000, sent
    time.sleep(0.5)
    assert group.run(_rank) == [0, 1]
    assert _pids(group) == pids and group.state == "ready"
