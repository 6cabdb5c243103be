"""A rank's interrupts (nbdist.runtime.worker_signals.Interrupts), in this process: the main
thread plays the rank's main thread, a helper thread its watchdog. Real SIGINTs throughout."""
import signal
import threading
import time

import pytest

from nbdist.runtime import worker_signals
from nbdist.runtime.worker_signals import Interrupts, sigint_ignored

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")]


@pytest.fixture
def interrupts():
    previous = signal.getsignal(signal.SIGINT)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield Interrupts(threading.main_thread().ident)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, previous)


def watchdog(interrupts, seq, after=0.0):
    """The watchdog reading "I<seq>;" ``after`` s from now."""
    def ask():
        time.sleep(after)
        interrupts.request(seq)
    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def sleep_until_interrupted(interrupts, seq):
    """Request ``seq``'s code sleeps; the watchdog interrupts it 0.1 s in; it raised once."""
    sigint_ignored()
    interrupts.begin(seq)
    thread = watchdog(interrupts, seq, after=0.1)
    with pytest.raises(KeyboardInterrupt):
        time.sleep(10)
    interrupts.end()
    thread.join()
    assert interrupts.delivered == 1


def test_an_interrupt_read_before_its_request_raises_as_the_code_starts(interrupts):
    sigint_ignored()
    watchdog(interrupts, 7).join()  # SIGINT is blocked and ignored: this one is dropped
    with pytest.raises(KeyboardInterrupt):
        interrupts.begin(7)
    interrupts.end()
    interrupts.begin(8)  # a later request is not interrupted
    time.sleep(0.05)
    interrupts.end()


def test_an_interrupt_of_running_code_raises_there_once(interrupts):
    sleep_until_interrupted(interrupts, 3)
    time.sleep(2 * sum(Interrupts.RESEND_S))  # nothing is sent again once it was answered
    assert interrupts.delivered == 1


def test_an_unanswered_interrupt_is_sent_again(interrupts, monkeypatch):
    """The first SIGINT goes unanswered (here: held back by the mask for 0.3 s, as CPython holds
    one that came just before a blocking call until the call returns); it is sent again until the
    handler runs, and then no more."""
    sigint_ignored()
    interrupts.begin(4)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    sent = []
    real = signal.pthread_kill

    def counting(tid, sig):  # count, and send for real
        sent.append(time.monotonic())
        real(tid, sig)

    monkeypatch.setattr(signal, "pthread_kill", counting)
    watchdog(interrupts, 4).join()
    time.sleep(0.3)
    with pytest.raises(KeyboardInterrupt):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        time.sleep(10)
    answered = len(sent)
    interrupts.end()
    time.sleep(2 * sum(Interrupts.RESEND_S))
    assert interrupts.delivered == 1
    assert answered >= 2, sent  # sent again while unanswered
    assert len(sent) <= answered + 1, sent  # then no more (one may have been on its way)


def test_code_with_its_own_sigint_handler_gets_the_interrupt_once(interrupts):
    """asyncio.run, for one, installs its own SIGINT handler: nbdist sends one SIGINT, never more
    (a second one means "stop now" to such handlers)."""
    sigint_ignored()
    interrupts.begin(5)
    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    watchdog(interrupts, 5).join()
    time.sleep(2 * sum(Interrupts.RESEND_S))
    interrupts.end()
    assert seen == [signal.SIGINT]


def spin(seconds):
    """Pure-Python work (no blocking call) for up to ``seconds``; an interrupt ends it early."""
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        n += 1
    return n


def test_without_pthread_kill_the_process_gets_the_sigint_and_the_main_thread_takes_it(
        interrupts, monkeypatch):
    """POSIX without ``pthread_kill``: SIGINT to the process; every other thread blocks it, so
    the main thread's sleep is cut short as with ``pthread_kill``."""
    monkeypatch.delattr(signal, "pthread_kill")
    sleep_until_interrupted(interrupts, 5)


def test_without_pthread_kill_or_masks_the_handler_alone_decides(interrupts, monkeypatch):
    """As on Windows (no ``pthread_kill``, no signal masks): the watchdog raises SIGINT on its own
    thread; CPython's C handler marks it for the main thread, which runs the handler installed
    when it looks -- KeyboardInterrupt in user code, nothing outside it (nbdist's messages)."""
    monkeypatch.delattr(signal, "pthread_kill")
    monkeypatch.setattr(worker_signals, "SIGINT_MASK", False)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])  # no masks, as on Windows
    sigint_ignored()
    watchdog(interrupts, 6).join()  # idle: the handler ignores it
    spin(0.3)
    interrupts.begin(7)
    thread = watchdog(interrupts, 7, after=0.1)
    with pytest.raises(KeyboardInterrupt):
        spin(10)
        raise AssertionError("the interrupt did not come")
    interrupts.end()
    thread.join()
    assert interrupts.delivered == 1
    watchdog(interrupts, 8).join()  # after the code: ignored again
    spin(0.3)
    assert interrupts.delivered == 1


def test_an_interrupt_read_after_a_later_request_began_is_dropped(interrupts):
    """The watchdog may read the interrupt of request 4 -- one whose request never came, as when
    Ctrl-C hit a submit between two ranks' requests -- only once request 5's code runs (a loaded
    machine). Was: the SIGINT went to the main thread all the same and request 5 raised
    KeyboardInterrupt (its all_reduce was left half done on the other rank)."""
    sigint_ignored()
    interrupts.begin(5)
    try:
        watchdog(interrupts, 4).join()
        time.sleep(2 * sum(Interrupts.RESEND_S))  # nothing raised here, nothing sent again
    except KeyboardInterrupt:  # (escaping, it would end the whole pytest run)
        pytest.fail("request 5 was interrupted by request 4's interrupt")
    interrupts.end()
    assert interrupts.delivered == 0
    interrupts.begin(6)  # and it does not wait for a later request either
    time.sleep(0.05)
    interrupts.end()
