"""The worker's side of a protected group (:mod:`nbdist.wire.seal`): its stdout and stderr go
through a pipe and a thread that seals what it reads, and a connection that fails its check ends the
process with a line that says why -- on the launcher's log (the worker's original stderr) and, while
the stream still works, to the caller.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional

from ..wire.seal import EXIT_TAMPERED, PUMPS, Seal, StreamPump, drain_pumps

_log_fd: Optional[int] = None  # the worker's stderr before it was redirected (the launcher's log)


def protect_fd(fd: int, sock, seal: Seal, refuse) -> None:
    """Make ``fd`` (1 or 2) a pipe whose contents a thread sends over ``sock`` in sealed frames."""
    global _log_fd
    if _log_fd is None:
        _log_fd = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, fd)
    os.close(write_fd)
    # The lifeline's watchdog only reads this socket: sends come from the pump alone.
    PUMPS.append(StreamPump(read_fd, sock, seal, threading.Lock(), lambda: _stream_lost(fd),
                            "stdout" if fd == 1 else "stderr"))


def _say(text: str) -> None:
    if _log_fd is not None:
        try:
            os.write(_log_fd, text.encode("utf-8", "backslashreplace"))
        except OSError:
            pass


def _stream_lost(fd: int) -> None:
    """The controller dropped this stream (it refused a frame, or is gone): exit, as the watchdog
    does when the controller goes away (the controller reports the rank)."""
    os._exit(70)


def refuse(rank: int, err: BaseException) -> None:
    """Report a failed integrity check (ours or the controller's) and exit with code 73."""
    text = (f"nbdist.worker: rank {rank}, connection to the controller: {err}; this rank exits "
            f"(code {EXIT_TAMPERED}).\n")
    _say(text)
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
        drain_pumps(1.0)
    except (OSError, ValueError):
        pass
    os._exit(EXIT_TAMPERED)
