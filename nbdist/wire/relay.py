"""Relay of every rank's stdout and stderr to the caller, line by line, labelled by rank; and each
rank's lifeline.

Each worker's file descriptors 1 and 2 are sockets to the caller -- or pipes that a thread of the
worker forwards to them (:mod:`.pump`: on Windows, with ``NBDIST_STREAMS=pipe``, in a protected
group) -- so everything a rank writes arrives here: Python prints, C++ warnings, the text of an
abort (through sockets even if the process then dies at once).
One background thread reads all of them; :meth:`OutputRelay.drain` lets the caller pull what has
already arrived before it returns a call's results, so a cell's output always precedes its value.

The stderr socket is also the rank's :class:`Lifeline`: the caller writes one-byte commands down it
(interrupt, kill, abort: the worker's watchdog thread acts on them, even while the rank is blocked
in a collective), and its end of stream says the process is gone. The relay only reads; the lifeline
only writes and tells liveness. :attr:`OutputRelay.on_close` hears, on the relay thread, of every
lifeline that closed: an attached group uses it to end the other ranks when one is lost.

In a protected group (:mod:`.seal`) the worker's pump thread sends in signed frames, the relay
checks each frame before showing a byte of it, and each command goes in a signed frame too. A stream whose frame fails its check is dropped and the rank stopped.
"""
from __future__ import annotations

import collections
import contextvars
import errno
import re
import selectors
import socket
import sys
import threading
import time
from typing import Callable, Deque, Dict, Optional, Tuple

from . import locks
from .deadline import Deadline, poll_until
from .seal import REFUSED_BY_US, FrameReader, IntegrityError, Seal
from .transport import UNANSWERED

Sink = Callable[[int, str, str], None]
Tick = Callable[[float], Optional[float]]
TAIL_LINES = 40
#: The exit code of a worker told to abort (its group failed): non-zero, so that torchrun/srun end
#: (or restart) the job instead of waiting for it; distinct from a crash or the lost-controller 70.
ABORT_EXIT_CODE = 75
#: seconds a drain waits for the output frames a protected rank said it sent before its reply
EXPECTED_S = 2.0


def default_sink(rank: int, stream: str, text: str) -> None:
    """Write ``[rank r] line`` to the caller's sys.stdout / sys.stderr."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    out.flush()


_INVISIBLE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-ln-~]")  # cursor, erase: CSI codes but colours


class Lifeline:
    """The caller's end of one rank's lifeline: commands down, liveness up.

    Safe from any thread. A command on a closed lifeline returns False (the rank is gone).
    """

    def __init__(self, rank: int, sock: socket.socket, closed: threading.Event,
                 seal: Optional[Seal] = None):
        self.rank = rank
        self._sock = sock
        self._closed = closed
        self._seal = seal  # protected: each command goes in a sealed frame
        self._lock = locks.make("lifeline")
        #: why the stream ended without an end of stream ("" if it ended or still runs): its
        #: host stopped answering (:data:`~nbdist.wire.transport.UNANSWERED`)
        self.why = ""

    def interrupt(self, seq: int) -> bool:
        """Interrupt request ``seq`` on the rank: SIGINT to its main thread (as the notebook's
        interrupt button would), or, if its code has not started yet, as soon as it starts."""
        return self._send(b"I%d;" % seq)

    def stacks(self, n: int, all_threads: bool = False) -> bool:
        """Ask the rank's watchdog for its main thread's stack (every thread's with
        ``all_threads``), answered as request ``n`` on the control channel
        (:mod:`nbdist.runtime.stacks`)."""
        return self._send(b"%s%d;" % (b"A" if all_threads else b"S", n))

    def kill(self) -> bool:
        """Make the rank SIGKILL itself (works for ranks on other hosts too)."""
        return self._send(b"K")

    def abort(self) -> bool:
        """Make the rank exit at once with :data:`ABORT_EXIT_CODE` (its group failed): unlike a
        kill, the launcher sees a plain failure exit, and the worker says why in its log."""
        try:  # its end of stream already here (the relay has not read it yet): it is gone
            if hasattr(socket, "MSG_DONTWAIT") and \
                    self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                return False
        except (BlockingIOError, InterruptedError):
            pass  # connected, nothing pending
        except OSError:
            return False
        return self._send(b"X")

    def _send(self, command: bytes) -> bool:
        if self._closed.is_set():
            return False
        try:
            if self._seal is None:
                self._sock.send(command)
            else:
                with self._lock:
                    self._sock.send(self._seal.frame(command))
            return True
        except OSError:
            return False

    @property
    def alive(self) -> bool:
        """False once the rank's stream has ended: the process is gone."""
        return not self._closed.is_set()

    def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the process to be gone; True if it is."""
        return self._closed.wait(timeout)


class OutputRelay:
    """Reads the ranks' output sockets on one thread and hands complete lines to a sink.

    ``tick(now)``, if given, is called on the relay thread (in :attr:`context`, under the relay's
    lock) after every read and whenever the seconds it last returned have passed (``None``: wake
    within a second): a sink that holds lines back releases them from there.
    """

    def __init__(self, sink: Optional[Sink] = None, tick: Optional[Tick] = None):
        self.sink: Sink = sink or default_sink
        self.tick = tick
        self.context: Optional[contextvars.Context] = None
        #: Called with the rank whose lifeline just closed (relay thread, under the relay's lock).
        self.on_close: Optional[Callable[[int], None]] = None
        self._sel = selectors.DefaultSelector()
        self._lock = locks.make("relay", reentrant=True)
        self._partial: Dict[Tuple[int, str], bytes] = {}
        self._tails: Dict[int, Deque[str]] = {}
        self._eof: Dict[Tuple[int, str], threading.Event] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._lifelines: Dict[int, Lifeline] = {}
        self._frames: Dict[Tuple[int, str], FrameReader] = {}
        self._got: Dict[Tuple[int, str], int] = {}  # sealed frames received per stream
        self._expected: Dict[Tuple[int, str], int] = {}  # ... and sent, as a rank last said
        self._thread = threading.Thread(target=self._loop, name="nbdist-output", daemon=True)
        self._thread.start()

    def add(self, rank: int, stream: str, sock: socket.socket, seal: Optional[Seal] = None) -> None:
        """Start relaying ``stream`` ("stdout"/"stderr") of ``rank`` from ``sock``; the stderr
        socket also becomes the rank's :meth:`lifeline`. With a ``seal`` the stream carries sealed
        frames: one that fails its check drops the stream (and says so on the rank's stderr)."""
        self._adopt(rank, stream, sock, FrameReader(seal) if seal is not None else None)

    def _adopt(self, rank: int, stream: str, sock: socket.socket, reader: Optional[FrameReader],
               partial: bytes = b"", got: int = 0, expected: Optional[int] = None) -> None:
        """Relay ``stream`` of ``rank`` from ``sock``: read through ``reader`` (a protected
        stream's, whose seal also signs the lifeline's commands), with what a relay it comes from
        held of it -- a partial line, the frames counted, the frames the rank said it sent --
        all in place before the relay thread can read a byte of it."""
        sock.setblocking(False)
        key = (rank, stream)
        with self._lock:
            self._eof[key] = threading.Event()
            self._tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES))
            if partial:
                self._partial[key] = partial
            if reader is not None:
                self._frames[key] = reader
                self._got[key] = got
            if expected is not None:
                self._expected[key] = expected
            self._sel.register(sock, selectors.EVENT_READ, key)
            if stream == "stderr":
                self._lifelines[rank] = Lifeline(rank, sock, self._eof[key],
                                                 reader.seal if reader is not None else None)
        self._wake_w.send(b"x")

    def lifeline(self, rank: int) -> Optional[Lifeline]:
        """Rank ``rank``'s lifeline (``None`` before its stderr stream connected)."""
        return self._lifelines.get(rank)

    def has(self, rank: int, stream: str) -> bool:
        """True if ``stream`` of ``rank`` is already being relayed (or was, until EOF)."""
        return (rank, stream) in self._eof

    def closed(self, rank: int) -> bool:
        """True once both streams of ``rank`` have closed."""
        events = [self._eof.get((rank, s)) for s in ("stdout", "stderr")]
        return all(e is not None and e.is_set() for e in events)

    def tail(self, rank: int) -> str:
        """The last lines rank ``rank`` wrote to stderr."""
        with self._lock:
            return "\n".join(self._tails.get(rank, ()))

    def wait_closed(self, rank: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s (both streams together) until both streams of ``rank`` reached
        EOF (the process is gone); True if so."""
        deadline = Deadline(timeout)  # one clock for the drains and the waits
        self.drain(wait=deadline.left())
        ok = True
        for stream in ("stdout", "stderr"):
            event = self._eof.get((rank, stream))
            if event is not None:
                ok = event.wait(deadline.left()) and ok
        self.drain(wait=deadline.left())
        return ok

    def expect(self, rank: int, sent: Dict[str, int]) -> None:
        """A protected rank sent ``sent[stream]`` output frames before the reply that follows:
        :meth:`drain` waits for them (streams and replies travel on different connections)."""
        with self._lock:
            for stream, count in sent.items():
                self._expected[(rank, stream)] = int(count)

    def _await_expected(self, wait: float) -> None:
        if not self._expected or threading.current_thread() is self._thread:
            return  # the relay thread itself reads them

        def arrived() -> bool:
            with self._lock:
                return all(self._got.get(k, 0) >= n or self._eof[k].is_set()
                           for k, n in self._expected.items() if k in self._eof)

        poll_until(arrived, lambda _: time.sleep(0.001), Deadline(wait))

    def drain(self, flush_partial: bool = False, wait: float = EXPECTED_S) -> None:
        """Relay, on this thread, everything that has already arrived on any stream (and, of a
        protected rank, every output frame it said it sent before its reply: up to ``wait`` s
        for them)."""
        self._await_expected(wait)
        with self._lock:
            if self._closed:
                return  # closed: every stream was read to its end or closed
            self._read_ready()
            if flush_partial:
                for (rank, stream), rest in list(self._partial.items()):
                    if rest:
                        self._partial[(rank, stream)] = b""
                        self._emit(rank, stream, rest.decode("utf-8", "backslashreplace"))

    def _loop(self) -> None:
        wait = 1.0
        while not self._closed:
            try:
                events = self._sel.select(timeout=wait)
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
                    if self._registered(key):
                        self._read(key.fileobj, key.data)
            wait = self._tick()

    def _tick(self) -> float:
        if self.tick is None:
            return 1.0
        with self._lock:
            try:
                if self.context is not None:
                    wait = self.context.run(self.tick, time.monotonic())
                else:
                    wait = self.tick(time.monotonic())
            except Exception as err:  # noqa: BLE001 -- as for the sink: the relay goes on
                sys.__stderr__.write(f"nbdist: output tick failed ({err!r})\n")
                wait = None
        return 1.0 if wait is None else min(1.0, max(wait, 0.01))

    def _registered(self, key: selectors.SelectorKey) -> bool:
        """(Under the lock.) True if ``key`` is still this relay's: a read made since the key was
        listed -- a drain inside :attr:`on_close`, a sink -- may have ended its stream, closed
        its socket, and another socket may have its number now."""
        return not self._closed and self._sel.get_map().get(key.fd) is key

    def _read_ready(self) -> None:
        """(Under the lock, open.) Read once each stream with bytes or its end to read: one poll
        that does not wait (the relay thread's own poll of the selector sees the same)."""
        for key, _ in self._sel.select(0):
            if key.data is not None and self._registered(key):
                self._read(key.fileobj, key.data)

    def _read(self, sock: socket.socket, who: Tuple[int, str]) -> None:
        """(Under the lock, ``sock`` registered.) The only place that ends a stream: on its end
        of stream it is unregistered and closed here, once."""
        chunks = []
        eof = False
        while True:
            try:
                data = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as err:
                eof = True
                if err.errno == errno.ETIMEDOUT and who[1] == "stderr" and \
                        who[0] in self._lifelines:  # keepalive gave up: no FIN ever came
                    self._lifelines[who[0]].why = UNANSWERED
                break
            if not data:
                eof = True
                break
            chunks.append(data)
        reader = self._frames.get(who)
        if chunks and reader is not None:
            try:
                chunks = reader.feed(b"".join(chunks))
                self._got[who] = self._got.get(who, 0) + len(chunks)
            except IntegrityError:
                chunks, eof = [], True  # nothing of a bad frame is shown; the stream is dropped
                self._emit(who[0], "stderr", f"nbdist: rank {who[0]}'s {who[1]} stream: "
                           f"{REFUSED_BY_US}; the rank is stopped.")
                if who[0] in self._lifelines:  # its stdout dropped: the rank cannot report
                    self._lifelines[who[0]].kill()  # (stderr dropped: the lifeline ends it)
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
            if who[1] == "stderr" and self.on_close is not None:
                try:
                    self.on_close(who[0])
                except Exception as err:  # noqa: BLE001 -- as for the sink: the relay goes on
                    sys.__stderr__.write(f"nbdist: lifeline hook failed ({err!r})\n")

    def _emit(self, rank: int, stream: str, text: str) -> None:
        if "\r" in text:  # progress bars redraw with \r: keep what the terminal would show
            text = "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))
        if "\x1b[" in text:  # nor cursor or erase codes: a line of them only (rich) is none
            text = "\n".join(kept for line in text.split("\n") for kept in
                              [_INVISIBLE.sub("", line)] if kept.strip() or kept == line)
            if not text:
                return
        if stream == "stderr":
            self._tails[rank].extend(text.splitlines())
        try:
            if self.context is not None:
                self.context.run(self.sink, rank, stream, text)
            else:
                self.sink(rank, stream, text)
        except Exception as err:  # noqa: BLE001 -- a broken sink must not kill the relay
            sys.__stderr__.write(f"nbdist: output sink failed ({err!r}); rank {rank}: {text}\n")

    def move_to(self, other: "OutputRelay") -> None:
        """Hand every open stream (with its partial line and stderr tail, and a protected
        stream's frame reader -- its seal, the part of a frame read so far -- and frame counts)
        to ``other``, then close this relay: ranks admitted in the background join the group's
        relay this way, signed as they were."""
        with self._lock:
            self._read_ready()  # what arrived so far goes out here
            for key in list(self._sel.get_map().values()):
                if key.data is not None:
                    self._sel.unregister(key.fileobj)
                    rank, stream = key.data
                    with other._lock:
                        other._tails.setdefault(rank, collections.deque(
                            maxlen=TAIL_LINES)).extend(self._tails.get(rank, ()))
                    other._adopt(rank, stream, key.fileobj, self._frames.pop(key.data, None),
                                 self._partial.pop(key.data, b""), self._got.pop(key.data, 0),
                                 self._expected.pop(key.data, None))
        self.close()

    def close(self) -> None:
        """Stop the relay thread and close every stream still open (idempotent)."""
        with self._lock:
            if self._closed:
                return
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
