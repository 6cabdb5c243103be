"""Scalars logged on a rank: ``nbdist.log(step=s, loss=loss)`` during any call on a group.

Each call appends one row per scalar to a buffer -- a tuple and a clock read, about a microsecond;
a flusher thread sends what is there to the caller over the control channel every :data:`FLUSH_S`
seconds, and the worker sends the rest before the call's reply, so a logged value reaches the
caller within about :data:`FLUSH_S` however rarely the code logs. The buffer is bounded: a
``log`` that finds :data:`MAX_BUFFER` rows waiting sends them itself, so a rank logging faster
than the caller reads waits rather than growing without end or dropping rows. The caller keeps the rows in the call's
:class:`~nbdist.runtime.metrics.Metrics`. Imported by the worker: no plotting, nothing above.
"""
from __future__ import annotations

import collections
import numbers
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

FLUSH_S = 0.2  #: a rank sends what it logged at least this often while a call runs
MAX_BUFFER = 50_000  #: rows waiting on a rank; a log() that finds more sends them itself

_buffer: "collections.deque[Tuple]" = collections.deque()  # appends and pops are thread-safe
_lock = threading.Lock()  # one batch at a time; end() and the flusher never interleave
_sender: Optional[Callable[[List[Tuple]], None]] = None
_rank: int = -1
_flusher: Optional[threading.Thread] = None


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
    if len(_buffer) >= MAX_BUFFER:  # logging faster than the flusher sends: send here (no loss)
        flush()


def flush() -> None:
    """Send what was logged so far (the flusher thread and the worker call it)."""
    with _lock:
        if _sender is None or not _buffer:
            return
        batch = [_buffer.popleft() for _ in range(len(_buffer))]
        _sender(batch)


def begin(rank: int, sender: Callable[[List[Tuple]], None]) -> None:
    """The worker starts a call: logged rows go to ``sender`` (one batch at a time)."""
    global _sender, _rank, _flusher
    with _lock:
        _sender, _rank = sender, rank
        _buffer.clear()
    if _flusher is None:
        _flusher = threading.Thread(target=_flush_forever, name="nbdist-log", daemon=True)
        _flusher.start()


def end() -> None:
    """The call is over: send the rest; further ``log`` calls are refused until the next call."""
    global _sender
    flush()
    with _lock:
        _sender = None


def _flush_forever() -> None:
    while True:
        time.sleep(FLUSH_S)
        try:
            flush()
        except OSError:  # the controller is gone: the worker exits on its own
            return


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
