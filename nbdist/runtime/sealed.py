"""A protected worker's side of a failed integrity check: its fds 1 and 2 are pipes whose contents
a thread sends in sealed frames (:class:`nbdist.wire.pump.PipePump`, set up by :mod:`.streams`);
a failed check ends the process with a line that says why -- on the launcher's log (the worker's
original stderr) and, while the stream still works, to the caller.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from ..wire import pump
from ..wire.pump import drain_pumps
from ..wire.seal import EXIT_TAMPERED

_log_fd: Optional[int] = None  # the worker's stderr before it was redirected (the launcher's log)


def keep_log_fd() -> None:
    """Keep the worker's stderr as it is now (the launcher's log), before fd 2 is redirected."""
    global _log_fd
    if _log_fd is None:
        _log_fd = os.dup(2)


def _say(text: str) -> None:
    if _log_fd is not None:
        try:
            os.write(_log_fd, text.encode("utf-8", "backslashreplace"))
        except OSError:
            pass


def stream_lost() -> None:
    """The controller dropped a stream (it refused a frame, or is gone): exit, as the watchdog
    does when the controller goes away (the controller reports the rank) -- unless the rank
    outlives its controller (``keep_alive``: :mod:`.orphan`)."""
    from . import orphan

    if not orphan.kept():
        pump.exit_now(70)


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
    pump.exit_now(EXIT_TAMPERED)
