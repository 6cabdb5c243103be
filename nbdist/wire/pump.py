"""Worker side: a file descriptor (1 or 2) made a pipe, and a thread that forwards what is written
to it over the stream's socket -- as it comes, or in sealed frames (:mod:`.seal`).

A rank's fds are pipes where a socket cannot be one: on Windows (a socket is a handle there, not a
C-runtime file descriptor, and ``dup2`` refuses it), in a protected group (every chunk is signed),
and anywhere with ``NBDIST_STREAMS=pipe`` (:mod:`nbdist.runtime.streams`). Only blocking reads and
writes are used: Windows' ``select`` takes sockets only.

Thread (one per stream, ``nbdist-pump-stdout`` / ``nbdist-pump-stderr``, a daemon started when the
rank connects its streams, never stopped: it ends with the process). It is the only reader of the
pipe and the only sender on the socket (the stderr socket's other user, the watchdog, only reads
it). It blocks in ``os.read``, sends what it read, and exits the process (``on_lost``) if the
socket fails: the caller dropped the stream, and the rank can report nothing any more.

Sync: :meth:`PipePump.drain` makes sure that what was written to the fd before it was called has
been sent, before a call's reply goes out (the caller shows a call's output before its value). A
pipe has no "everything read" signal that works on every platform without ``select`` (asking the
OS how many bytes it holds leaves a window: the pump may have read bytes it has not yet sent), so
the pump marks the place itself: ``drain`` writes a marker -- 16 bytes, random per pump, starting
with 0xFF, which UTF-8 text never contains -- into the pipe and waits until the pump has read up to
it; everything before the marker has then been sent. The pump strips markers from the stream, and
holds back a chunk's last bytes while they could be the start of one. Writes of at most
``PIPE_BUF`` bytes to a pipe are not torn by other writers, so a marker arrives whole.

Locks (leaves): each pump's condition, guarding the markers asked and seen, and its writing lock,
under which a marker is counted (taking the condition for that alone) and written, so markers reach
the pipe in the order they were counted. A marker is never written under the condition: the write
blocks while the pipe is full, and the pump needs the condition to go on reading.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, List, Optional

from .seal import Seal

CHUNK = 1 << 16  #: the most one read takes from the pipe (one send, one sealed frame)


class PipePump:
    """Make ``fd`` write into a pipe whose contents a thread sends over ``sock``.

    ``seal``: send each chunk in a sealed frame (protected groups); :attr:`sent` counts them.
    ``on_lost``: called on the pump thread when a send fails (it should end the process).
    """

    def __init__(self, fd: int, sock, seal: Optional[Seal] = None,
                 on_lost: Callable[[], None] = lambda: exit_now(70), name: str = ""):
        self.sock, self.seal, self.on_lost = sock, seal, on_lost
        self.name = name  #: "stdout" / "stderr"
        self.sent = 0  #: frames (or plain chunks) sent so far; written by the pump thread only
        self._read_fd, self._write_fd = os.pipe()
        os.dup2(self._write_fd, fd)  # fd now writes into the pipe; _write_fd stays ours: markers
        self._mark = b"\xff" + os.urandom(15)
        self._cond = threading.Condition(threading.Lock())
        self._writing = threading.Lock()
        self._asked = 0  # markers written (under _cond)
        self._seen = 0  # markers the pump has read, everything before them sent (under _cond)
        self._done = False  # the pump thread has ended (under _cond)
        self.thread = threading.Thread(target=self._loop, name=f"nbdist-pump-{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        held = b""  # the end of the last chunk, while it could be the start of a marker
        try:
            while True:
                data = os.read(self._read_fd, CHUNK)
                if not data:
                    return  # every write end closed: nothing more can come
                data, held = held + data, b""
                while True:
                    at = data.find(self._mark)
                    if at < 0:
                        break
                    self._send(data[:at])
                    data = data[at + len(self._mark):]
                    with self._cond:
                        self._seen += 1
                        self._cond.notify_all()
                keep = self._marker_start(data)
                if keep:
                    data, held = data[:-keep], data[-keep:]
                self._send(data)
        except OSError:
            self.on_lost()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _marker_start(self, data: bytes) -> int:
        """How many of ``data``'s last bytes could begin a marker (0: none)."""
        tail = data[-(len(self._mark) - 1):]
        at = tail.find(self._mark[:1])
        while at >= 0:
            if self._mark.startswith(tail[at:]):
                return len(tail) - at
            at = tail.find(self._mark[:1], at + 1)
        return 0

    def _send(self, data: bytes) -> None:
        if not data:
            return
        if self.seal is not None:
            head, tail = self.seal.wrap(data)
            self.sock.sendall(head + data + tail)
        else:
            self.sock.sendall(data)
        self.sent += 1

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until what was written to the fd before this call has been sent (any thread);
        False if that took longer than ``timeout`` seconds or the pump has ended. Writing the
        marker waits while the pipe is full, as the writes before it did."""
        return self.wait(self.mark(), timeout)

    def mark(self) -> int:
        """Write a marker behind what was written so far; return its number for :meth:`wait`
        (0: the pump has ended)."""
        with self._writing:  # markers reach the pipe in the order they are counted
            with self._cond:
                if self._done:
                    return 0
                self._asked += 1
                want = self._asked
            os.write(self._write_fd, self._mark)  # blocks while the pipe is full: never under _cond
        return want

    def wait(self, want: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the pump has read marker ``want`` (True once it has)."""
        with self._cond:
            return want > 0 and self._cond.wait_for(
                lambda: self._seen >= want or self._done, timeout) and self._seen >= want

    def close(self, timeout: float = 5.0) -> None:
        """Stop once what was written has been read (once the redirected fd is closed too): a
        rank never calls this, its pumps end with the process."""
        os.close(self._write_fd)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            os.close(self._read_fd)


PUMPS: List[PipePump] = []  #: this process's pumps (a worker has at most one per stream)


def abandon_pumps() -> None:
    """Worker side, its controller gone (``keep_alive``): forget this process's pumps, their
    threads ending once their pipe is drained; new streams bring new pumps."""
    for old in PUMPS:
        try:
            os.close(old._write_fd)  # the fds were pointed elsewhere: the pipe ends, its thread too
        except OSError:
            pass
    PUMPS.clear()


def exit_now(code: int) -> None:
    """End this process at once, without the wait for the pumps that a rank's ``os._exit`` makes
    (:mod:`nbdist.runtime.streams`): nbdist's own exits, when the caller is gone or has been told."""
    getattr(os._exit, "__wrapped__", os._exit)(code)


def sent_counts() -> Dict[str, int]:
    """Worker side: frames sent so far per sealed stream (``{}`` where none is sealed). Sent to
    the caller before a reply, so it shows all of a call's output before it ends the call, although
    the streams and the reply travel on different connections."""
    return {pump.name: pump.sent for pump in PUMPS if pump.seal is not None}


def drain_pumps(timeout: float = 5.0) -> None:
    """Worker side: wait until every pump sent what was written so far (no-op without pumps).
    Every marker is written before any is waited for: the pumps forward them side by side."""
    if not PUMPS:  # fds 1 and 2 are the sockets themselves: nothing in between to wait for
        return
    marks = [(pump, pump.mark()) for pump in PUMPS]
    deadline = time.monotonic() + timeout
    for pump, want in marks:
        pump.wait(want, max(0.0, deadline - time.monotonic()))
