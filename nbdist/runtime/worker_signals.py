"""SIGINT on a rank: delivered to the user's code only, never to nbdist's own talking.

SIGINT reaches a rank's main thread only while the user's code runs (Python's default handler
then raises KeyboardInterrupt). The rest of the time it is blocked in the main thread -- and in
every thread started at start-up, which inherit the mask -- and ignored: a stray interrupt (a
burst from the notebook's interrupt button, one that lands as a call ends) can never kill the
rank or tear a message. Where it matters the C functions of ``_signal`` are called, not
``signal``'s Python wrappers: entering a Python function is a point where CPython runs the
handlers of signals already received.
"""
from __future__ import annotations

import _signal
import signal


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


def sigint_to_user() -> None:
    """Before the user's code: interrupts that came while the rank was idle are dropped (they are
    delivered as SIGINT is unblocked, still to the ignoring handler), then SIGINT raises
    KeyboardInterrupt."""
    if SIGINT_MASK:
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, SIGINT_SET)
    _signal.signal(_signal.SIGINT, signal.default_int_handler)
