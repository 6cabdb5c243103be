"""A rank's stdout and stderr: how its file descriptors 1 and 2 reach the caller.

The file descriptors themselves are redirected, not only ``sys.stdout``: C and C++ output (torch's
warnings, ``os.write(1, ...)``, the text of an abort) must reach the notebook too. Two ways:

``socket`` (the default on POSIX)
    fd 1 and fd 2 *are* the stream sockets (``dup2``). A write is on its way to the caller when it
    returns, so even the last words of a process that dies at once arrive.
``pipe`` (the only way on Windows; elsewhere with ``NBDIST_STREAMS=pipe``)
    fd 1 and fd 2 are pipes, and a thread per stream forwards what is written over the socket
    (:class:`nbdist.wire.pump.PipePump`): a Windows socket is a handle, not a C-runtime file
    descriptor, so ``dup2`` refuses it. What a process writes just before a crash may not be
    forwarded: the pump dies with it.

Either way, a rank that ends itself with ``os._exit`` is heard to its last line: on a rank,
``os._exit`` first flushes ``sys.stdout`` / ``sys.stderr`` (Python's buffers, which ``os._exit``
skips) and lets the pumps forward what was written (:data:`LAST_WORDS_S` at most).

A protected group (:mod:`.sealed`) always uses pipes, each chunk sent in a sealed frame.
The stderr socket is also the rank's lifeline: the watchdog (:mod:`.rankserver`) reads the
caller's commands from it; only the pump (or the fd) writes to it.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

from ..wire import pump, transport
from . import sealed

ENV_VAR = "NBDIST_STREAMS"  #: chooses how a rank's fds 1 and 2 reach the caller
#: how long ``os._exit`` on a rank waits for the pumps to forward its last words
LAST_WORDS_S = 1.0
WINDOWS = sys.platform == "win32"


def stream_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """``"socket"`` or ``"pipe"``: what ``NBDIST_STREAMS`` in ``environ`` (default: this
    process's environment) asks for, else this platform's default; raises on anything else."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    usable = ("pipe",) if WINDOWS else ("socket", "pipe")
    if not value:
        return usable[0]
    if value not in usable:
        why = (" (a Windows socket is a handle, not a C-runtime file descriptor: it cannot "
               "be a rank's stdout)") if WINDOWS and value == "socket" else ""
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(map(repr, usable))} on this "
                         f"platform, got {value!r}{why}; unset it for the default "
                         f"({usable[0]!r}).")
    return value


def connect(cfg: Dict[str, Any]) -> Tuple[Any, Optional[Any]]:
    """Connect this process's fds 1 and 2 to the caller (``cfg``: the worker's config); return
    the stderr socket and its seal (``None`` unprotected): the lifeline the watchdog reads."""
    mode = stream_mode()
    rank = cfg["rank"]
    lifeline = None
    for fd, stream in ((1, "stdout"), (2, "stderr")):
        sock, seal = transport.connect_session(tuple(cfg["address"]), cfg["key"],
                                               {"rank": rank, "role": stream, "pid": os.getpid()})
        current = sys.stdout if fd == 1 else sys.stderr
        if current is not None:  # None: started without that handle (Windows, no console)
            current.flush()
        if seal is not None:  # protected: fd -> pipe -> a thread that seals -> socket
            sealed.keep_log_fd()
            pump.PUMPS.append(pump.PipePump(fd, sock, seal, sealed.stream_lost, stream))
        elif mode == "pipe":
            pump.PUMPS.append(pump.PipePump(fd, sock, None, sealed.stream_lost, stream))
        else:
            os.dup2(sock.fileno(), fd)
            if fd == 1:
                sock.close()  # fd 1 holds the connection now
        if fd == 2:
            lifeline = (sock, seal)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                      closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                      closefd=False)
    _keep_last_words()
    return lifeline


def _keep_last_words() -> None:
    """Make ``os._exit`` on this rank flush Python's buffers and drain the pumps first."""
    real = getattr(os._exit, "__wrapped__", os._exit)

    def _exit(code: int) -> None:
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            pump.drain_pumps(LAST_WORDS_S)
        except (OSError, ValueError):  # a closed stream, a broken socket: exit all the same
            pass
        real(code)

    _exit.__wrapped__ = real
    _exit.__doc__ = real.__doc__
    os._exit = _exit
