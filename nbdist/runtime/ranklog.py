"""Scalars logged on a rank: ``nbdist.log(step=s, loss=loss)`` during any call on a group.

Each call appends one row per scalar to a buffer -- a tuple and a clock read, about a microsecond
-- and the buffer goes to the caller over the control channel when it is older than
:data:`FLUSH_S`, and always before the call's reply. The caller keeps the rows in the call's
:class:`~nbdist.runtime.metrics.Metrics`. Imported by the worker: no plotting, nothing above.
"""
from __future__ import annotations

import numbers
import time
from typing import Any, Callable, List, Optional, Tuple

FLUSH_S = 0.2  #: a rank sends what it logged at least this often while a call runs

_buffer: List[Tuple] = []
_sender: Optional[Callable[[List[Tuple]], None]] = None
_rank: int = -1
_last_flush = 0.0


def log(step: Optional[int] = None, **scalars: Any) -> None:
    """Record scalars on this rank: ``nbdist.log(step=i, loss=loss, lr=lr)``.

    Values are Python numbers or 0-d tensors (``.item()`` is taken here). Call it inside any call
    on a group (blocking or background); the values reach ``job.metrics`` within about a second.
    """
    if _sender is None:
        raise RuntimeError("nbdist.log() records metrics on a rank of an nbdist group: call it "
                           "in code that runs there (g.run / g.submit / %%dist), not in the kernel.")
    now = time.time()
    for name, value in scalars.items():
        if not isinstance(value, numbers.Number):
            item = getattr(value, "item", None)
            if item is None or getattr(value, "numel", lambda: 0)() != 1:
                raise TypeError(f"nbdist.log({name}=...) takes a number or a 0-d tensor, got "
                                f"{type(value).__name__}")
            value = item()
        _buffer.append((_rank, step, name, value, now))
    if now - _last_flush >= FLUSH_S:
        flush()


def flush() -> None:
    """Send what was logged so far (the worker calls it before every reply)."""
    global _buffer, _last_flush
    _last_flush = time.time()
    if _buffer and _sender is not None:
        batch, _buffer = _buffer, []
        _sender(batch)


def begin(rank: int, sender: Callable[[List[Tuple]], None]) -> None:
    """The worker starts a call: logged rows go to ``sender`` (one batch at a time)."""
    global _sender, _rank, _last_flush, _buffer
    _sender, _rank, _last_flush, _buffer = sender, rank, time.time(), []


def sender(channel, seq: int) -> Callable[[List[Tuple]], None]:
    """Batches go to the caller as ``("log", seq, batch, [])`` on the control channel; SIGINT
    waits until the message is whole (an interrupt must never tear the channel)."""
    import signal

    mask = hasattr(signal, "pthread_sigmask")

    def send(batch: List[Tuple]) -> None:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if mask else None
        try:
            channel.send(("log", seq, batch, []))
        finally:
            if old is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return send


def end() -> None:
    """The call is over: send the rest; further ``log`` calls are refused until the next call."""
    global _sender
    flush()
    _sender = None
