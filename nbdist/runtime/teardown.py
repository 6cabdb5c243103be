"""Teardown that runs to its end: however often Ctrl-C comes, and whichever step fails.

A teardown that stops halfway leaks what it had not reached yet -- the output relay's thread, the
temp dir, the rendezvous store, ranks still running -- and nothing holds them any more. So:

* :func:`interrupts_deferred` -- on the main thread (the only one Python delivers signals to),
  SIGINT is noted instead of raised while the block runs, then handed to the handler that was in
  place (``KeyboardInterrupt`` by default) once the block is done. Every teardown step is bounded
  (:mod:`.ranks` waits on one shared deadline), so the wait for it is too.
* :func:`run_all` -- every step runs even when one before it raised; the first error is raised
  after the last step.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator, List


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Run the block to its end; a SIGINT meanwhile reaches the previous handler after it."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: nothing can interrupt this one
        return
    previous = signal.getsignal(signal.SIGINT)
    noted: List[object] = []
    try:
        if previous is None:  # a handler set outside Python: it could not be put back
            raise ValueError("no Python SIGINT handler")
        signal.signal(signal.SIGINT, lambda signum, frame: noted.append(frame))
        swapped = True
    except (ValueError, OSError):  # that, or not the main interpreter
        swapped = False
    if not swapped:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if noted:
            if callable(previous):  # default_int_handler raises KeyboardInterrupt here
                previous(signal.SIGINT, noted[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def run_all(*steps: Callable[[], object]) -> None:
    """Run every step, even after one raised; then raise the first error (if any)."""
    error = None
    for step in steps:
        try:
            step()
        except BaseException as err:  # noqa: BLE001 -- raised after the other steps ran
            if error is None:
                error = err
    if error is not None:
        raise error
