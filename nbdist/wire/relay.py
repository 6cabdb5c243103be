"""Relay of every rank's stdout and stderr to the caller, line by line, labelled by rank.

Each worker's file descriptors 1 and 2 are sockets to the caller, so everything a rank writes --
Python prints, C++ warnings, the text of an abort -- arrives here even if the process then dies.
One background thread reads all of them; :meth:`OutputPump.drain` lets the caller pull what has
already arrived before it returns a call's results, so a cell's output always precedes its value.
"""
from __future__ import annotations

import collections
import contextvars
import selectors
import socket
import sys
import threading
from typing import Callable, Deque, Dict, Optional, Tuple

Sink = Callable[[int, str, str], None]
TAIL_LINES = 40


def default_sink(rank: int, stream: str, text: str) -> None:
    """Write ``[rank r] line`` to the caller's sys.stdout / sys.stderr."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    out.flush()


class OutputPump:
    """Reads the ranks' output sockets on one thread and hands complete lines to a sink."""

    def __init__(self, sink: Optional[Sink] = None):
        self.sink: Sink = sink or default_sink
        self.context: Optional[contextvars.Context] = None
        self._sel = selectors.DefaultSelector()
        self._lock = threading.RLock()
        self._partial: Dict[Tuple[int, str], bytes] = {}
        self._tails: Dict[int, Deque[str]] = {}
        self._eof: Dict[Tuple[int, str], threading.Event] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self.on_eof: Optional[Callable[[int], None]] = None
        self._thread = threading.Thread(target=self._loop, name="nbdist-output", daemon=True)
        self._thread.start()

    def add(self, rank: int, stream: str, sock: socket.socket) -> None:
        """Start relaying ``stream`` ("stdout"/"stderr") of ``rank`` from ``sock``."""
        sock.setblocking(False)
        with self._lock:
            self._eof[(rank, stream)] = threading.Event()
            self._tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES))
            self._sel.register(sock, selectors.EVENT_READ, (rank, stream))
        self._wake_w.send(b"x")

    def send(self, rank: int, command: bytes) -> bool:
        """Send a one-byte command up rank ``rank``'s stderr stream (the worker's watchdog reads
        it: ``b"I"`` interrupt, ``b"K"`` kill). False if the stream is already closed."""
        with self._lock:
            for key in self._sel.get_map().values():
                if key.data == (rank, "stderr"):
                    try:
                        key.fileobj.send(command)
                        return True
                    except OSError:
                        return False
        return False

    def has(self, rank: int, stream: str) -> bool:
        """True if ``stream`` of ``rank`` is already being relayed (or was, until EOF)."""
        return (rank, stream) in self._eof

    def eof_seen(self, rank: int) -> bool:
        """True once both streams of ``rank`` have closed."""
        events = [self._eof.get((rank, s)) for s in ("stdout", "stderr")]
        return all(e is not None and e.is_set() for e in events)

    def tail(self, rank: int) -> str:
        """The last lines rank ``rank`` wrote to stderr."""
        with self._lock:
            return "\n".join(self._tails.get(rank, ()))

    def wait_eof(self, rank: int, timeout: float) -> bool:
        """Wait until both streams of ``rank`` reached EOF (the process is gone); True if so."""
        self.drain()
        ok = True
        for stream in ("stdout", "stderr"):
            event = self._eof.get((rank, stream))
            if event is not None:
                ok = event.wait(timeout) and ok
        self.drain()
        return ok

    def drain(self, flush_partial: bool = False) -> None:
        """Relay, on this thread, everything that has already arrived on any stream."""
        with self._lock:
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    self._read(key.fileobj, key.data)
            if flush_partial:
                for (rank, stream), rest in list(self._partial.items()):
                    if rest:
                        self._partial[(rank, stream)] = b""
                        self._emit(rank, stream, rest.decode("utf-8", "backslashreplace"))

    def _loop(self) -> None:
        while not self._closed:
            try:
                events = self._sel.select(timeout=1.0)
            except (OSError, ValueError):
                if self._closed:
                    return
                continue
            if self._closed:
                return
            for key, _ in events:
                if key.data is None:
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                    continue
                with self._lock:
                    if key.fd in self._sel.get_map():
                        self._read(key.fileobj, key.data)

    def _read(self, sock: socket.socket, who: Tuple[int, str]) -> None:
        chunks = []
        eof = False
        while True:
            try:
                data = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                eof = True
                break
            if not data:
                eof = True
                break
            chunks.append(data)
        if chunks:
            buf = self._partial.get(who, b"") + b"".join(chunks)
            head, sep, rest = buf.rpartition(b"\n")
            self._partial[who] = rest
            if sep:
                self._emit(who[0], who[1], head.decode("utf-8", "backslashreplace"))
        if eof:
            rest = self._partial.pop(who, b"")
            if rest:
                self._emit(who[0], who[1], rest.decode("utf-8", "backslashreplace"))
            self._sel.unregister(sock)
            sock.close()
            self._eof[who].set()
            if self.on_eof is not None and who[1] == "stderr":
                self.on_eof(who[0])

    def _emit(self, rank: int, stream: str, text: str) -> None:
        if "\r" in text:  # progress bars redraw with \r: keep what the terminal would show
            text = "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))
        if stream == "stderr":
            self._tails[rank].extend(text.splitlines())
        try:
            if self.context is not None:
                self.context.run(self.sink, rank, stream, text)
            else:
                self.sink(rank, stream, text)
        except Exception as err:  # noqa: BLE001 -- a broken sink must not kill the relay
            sys.__stderr__.write(f"nbdist: output sink failed ({err!r}); rank {rank}: {text}\n")

    def close(self) -> None:
        """Stop the relay thread and close every stream still open."""
        with self._lock:
            self._closed = True
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    self._sel.unregister(key.fileobj)
                    key.fileobj.close()
        self._wake_w.send(b"x")
        self._thread.join(timeout=2.0)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
