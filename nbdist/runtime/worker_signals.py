"""SIGINT on a rank: delivered to the user's code only, never to nbdist's own talking.

SIGINT reaches a rank's main thread only while the user's code runs (Python's default handler
then raises KeyboardInterrupt). The rest of the time it is blocked in the main thread -- and in
every thread started at start-up, which inherit the mask -- and ignored: a stray interrupt (a
burst from the notebook's interrupt button, one that lands as a call ends) can never kill the
rank or tear a message. Where it matters the C functions of ``_signal`` are called, not
``signal``'s Python wrappers: entering a Python function is a point where CPython runs the
handlers of signals already received.

Where there is no ``pthread_kill`` and no signal mask (Windows) the interrupt is
``signal.raise_signal(SIGINT)`` on the watchdog thread: the C runtime runs CPython's C handler
there, which marks SIGINT for the main thread's next check between bytecodes and, on Windows, sets
the event that the main thread's ``time.sleep`` (and lock waits) also wait on, so a sleep ends at
once. ``_thread.interrupt_main`` would only mark it (its documentation: it "does not emit the
corresponding signal"): a sleep would run to its end. A blocking socket read is not interrupted
on Windows either way. Without a mask, "ignored outside user code" is the handler's doing alone:
the main thread runs the handler installed when it *checks*, and outside user code that is
:func:`ignore_sigint`, so nbdist's own messages are never torn.
"""
from __future__ import annotations

import _signal
import os
import select
import signal
import threading
import time
from typing import Optional

from ..wire import locks


def ignore_sigint(signum, frame):
    """SIGINT outside user code (while talking to the controller) is ignored: no torn messages."""


SIGINT_SET = {_signal.SIGINT}
SIGINT_MASK = hasattr(_signal, "pthread_sigmask")  # not on Windows


def sigint_ignored() -> None:
    """SIGINT blocked in this thread (and in the threads it starts from now on), then ignored.
    Once the mask is set only an interrupt received before can still be raised."""
    if SIGINT_MASK:
        _signal.pthread_sigmask(_signal.SIG_BLOCK, SIGINT_SET)
    _signal.signal(_signal.SIGINT, ignore_sigint)


def sigint_to_user(handler=signal.default_int_handler) -> None:
    """Before the user's code: interrupts that came while the rank was idle are dropped (they are
    delivered as SIGINT is unblocked, still to the ignoring handler), then SIGINT raises
    KeyboardInterrupt (through ``handler``)."""
    if SIGINT_MASK:
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, SIGINT_SET)
    _signal.signal(_signal.SIGINT, handler)


_RAISING = locks.make("raising", module_level=True)  # one raise_signal at a time: Windows' C runtime resets SIGINT's
# handler to SIG_DFL while it runs it (CPython's handler puts itself back), and a second SIGINT
# raised in between would end the process


def sigint_to_main(main_id: int) -> None:
    """SIGINT for the main thread (``main_id``), from another thread, on any platform."""
    kill = getattr(signal, "pthread_kill", None)
    if kill is not None:
        kill(main_id, signal.SIGINT)
    elif SIGINT_MASK:  # POSIX without pthread_kill: the main thread is the one not blocking it
        os.kill(os.getpid(), signal.SIGINT)
    else:  # Windows: CPython's C handler runs on this thread and wakes the main thread's waits
        with _RAISING:
            signal.raise_signal(signal.SIGINT)


class Interrupts:
    """The controller's interrupts of one rank's requests, each named by its sequence number.

    The watchdog thread :meth:`asks <request>`; the main thread runs each request's code between
    :meth:`begin` and :meth:`end`. Two races lose a plain SIGINT and a third misplaces one; all
    three are closed here:

    * the interrupt travels on the lifeline, the request on the channel, so the interrupt may be
      read before its request's code starts, when SIGINT is still ignored: :meth:`begin` then
      raises KeyboardInterrupt itself;
    * a SIGINT that lands after CPython's last check for signals and before a blocking call starts
      (``time.sleep``, a socket read) is seen only when that call returns (it was not interrupted,
      the signal came before it): SIGINT is sent again, :data:`RESEND_S` apart, until its handler
      has run or the request's code is over;
    * an interrupt read late -- its request is over, or never came to this rank (Ctrl-C between
      two ranks' requests) -- while another request's code runs is dropped: the move between
      requests (:meth:`begin`, :meth:`end`) and each SIGINT sent take one lock, so none meant for
      one request lands in another's code.

    So while a request's code runs, SIGINT's handler is this object's (it raises
    KeyboardInterrupt, as Python's default handler does, and counts): not
    ``signal.default_int_handler`` itself. Code that installs its own handler gets no resend.
    """

    #: pauses before each SIGINT sent again while the first is unanswered
    RESEND_S = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8)

    def __init__(self, main_id: int):
        self.main_id = main_id
        self.latest = -1  #: the latest request interrupted (the watchdog writes it)
        self.running: Optional[int] = None  #: the request whose code runs (the main thread's)
        self.delivered = 0  #: SIGINTs whose handler ran (the main thread's)
        # held while the main thread moves between requests (``running`` and the mask change
        # together) and while the watchdog decides to send a SIGINT and sends it: a SIGINT meant
        # for a request never lands in another one's code
        self._moving = locks.make("interrupts")

    def _raise(self, signum, frame):
        self.delivered += 1
        raise KeyboardInterrupt

    def begin(self, seq: int) -> None:
        """Main thread, before request ``seq``'s code: from here SIGINT raises KeyboardInterrupt,
        and an interrupt that overtook the request raises it at once."""
        with self._moving:
            self.running = seq
            sigint_to_user(self._raise)
        if self.latest >= seq:
            raise KeyboardInterrupt

    def end(self) -> None:
        """Main thread, once the code is over: SIGINT blocked and ignored again."""
        with self._moving:
            self.running = None
            sigint_ignored()

    def request(self, seq: int) -> None:
        """Watchdog thread: interrupt request ``seq`` -- unless another request's code runs (the
        interrupt was read late, on a loaded machine: ``seq`` is over, or its request never came)."""
        with self._moving:
            self.latest = max(self.latest, seq)
            if self.running not in (None, seq):
                return
            delivered = self.delivered
            sigint_to_main(self.main_id)  # idle: blocked and ignored, dropped at the next begin
            running = self.running == seq
        if running:
            threading.Thread(target=self._insist, args=(seq, delivered), daemon=True,
                             name="nbdist-interrupt").start()

    def _insist(self, seq: int, delivered: int) -> None:
        for pause in self.RESEND_S:
            time.sleep(pause)
            with self._moving:
                if self.delivered != delivered or self.running != seq or \
                        signal.getsignal(signal.SIGINT) != self._raise:  # the user's own handler
                    return
                sigint_to_main(self.main_id)


def recv_whole(channel):
    """The next message on ``channel``: an interrupt (the call being stopped) may end the wait
    for it, never cut it in half -- SIGINT waits while a message is read, so the channel stays
    whole."""
    select.select([channel], [], [])
    if not SIGINT_MASK:  # Windows: no signal mask (and no SIGINT inside a socket read)
        return channel.recv()
    held = _signal.pthread_sigmask(_signal.SIG_BLOCK, SIGINT_SET)
    try:
        return channel.recv()
    finally:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, held)
