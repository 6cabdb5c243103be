"""The control channel between the caller and its workers: authentication and message framing.

Every connection starts with a mutual HMAC-SHA256 challenge on a per-group random key (the same idea
as ``multiprocessing.connection``), done on raw bytes with a deadline. Only after both sides proved
they hold the key is anything unpickled. Then messages travel as ``8-byte length + pickle``.

A failed or slow handshake raises :class:`AuthenticationError` and the socket is closed; the peer
learns nothing and nothing it sent is interpreted.

A peer whose host vanishes (power lost, cable pulled) sends no FIN: every connection the controller
accepts, and the worker's lifeline, probe a silent peer (:func:`keepalive`) and give it up after
:data:`PEER_SILENCE` seconds without an answer; a message that stops halfway is given up after
:data:`MESSAGE_STALL` seconds without a byte. :attr:`Channel.failure` then says why.

The server (the controller) decides whether the connection is *protected* and says so in its
authenticated answer (a mode byte covered by its MAC, so nobody on the path can turn it off). On a
protected connection the hello and every later message is sealed (:mod:`nbdist.wire.seal`).
"""
from __future__ import annotations

import errno
import hmac
import json
import os
import pickle
import select
import socket
import struct
import time
from hashlib import sha256
from typing import Any, Dict, Optional, Tuple

from . import locks
from .deadline import WAKE_S, Deadline, poll_until
from . import seal as seal_module
from .seal import IntegrityError, Seal, read_frame  # noqa: F401 -- IntegrityError: re-exported

MAGIC = b"NBDIST02"
NONCE = 32
DIGEST = 32
_HEADER = struct.Struct("!Q")
_MAX_HELLO = 4096
HANDSHAKE_TIMEOUT = 10.0
_PLAIN, _SEALED = b"-", b"P"
#: s without an answer after which a peer's host counts as gone (keepalive probes from 4 s of
#: silence, 2 s apart; ``TCP_USER_TIMEOUT`` where the OS has it also bounds unacknowledged data)
PEER_SILENCE = 10
#: s without a byte, halfway through a message, after which the peer counts as gone
MESSAGE_STALL = 30.0
UNANSWERED = (f"no answer from its host for {PEER_SILENCE} s (the host is down, or the network to "
              "it is cut)")


class AuthenticationError(ConnectionError):
    """A peer failed the key challenge, sent malformed bytes, or took too long."""


def new_key() -> bytes:
    """A fresh random 32-byte group key."""
    return os.urandom(32)


def _mac(key: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, label + nonce, sha256).digest()


class MessageStalled(TimeoutError):
    """The peer sent part of a message, then nothing for :data:`MESSAGE_STALL` seconds."""


def keepalive(sock: socket.socket) -> None:
    """Probe ``sock``'s peer when it is silent: from 4 s of silence, 2 s apart; a peer whose host
    answers nothing for :data:`PEER_SILENCE` s is gone (the socket then fails with ETIMEDOUT).
    Each option is set where the OS has it (``TCP_KEEPIDLE``... are Linux names; macOS calls the
    first ``TCP_KEEPALIVE``; ``TCP_USER_TIMEOUT``, Linux only, also bounds unacknowledged data)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPALIVE", 4), ("TCP_KEEPINTVL", 2),
                            ("TCP_KEEPCNT", (PEER_SILENCE - 4) // 2),
                            ("TCP_USER_TIMEOUT", PEER_SILENCE * 1000)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError:
        pass  # not a TCP socket (a socketpair in tests), or an old kernel: EOF still tells


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether ``sock`` has something to read (or failed) within ``timeout`` s, waiting at most
    :data:`~nbdist.wire.deadline.WAKE_S` at a time: a Ctrl-C the OS handed to another thread
    ends the wait of a main thread reading a stalled message at once, not ``timeout`` s later."""
    seen = []
    if hasattr(select, "poll"):  # no FD_SETSIZE limit
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)

        def step(seconds):
            seen.extend(poller.poll(seconds * 1000))
    else:
        def step(seconds):  # Windows: sockets only anyway
            seen.extend(select.select([sock], [], [sock], seconds)[0])
    if timeout <= 0:  # poll_until would find its deadline passed before it looked
        step(0)
        return bool(seen)
    return poll_until(lambda: bool(seen), step, Deadline(timeout), cap=WAKE_S)


def _recv_now(sock: socket.socket, view: memoryview) -> Optional[int]:
    """Read what ``sock`` already holds into ``view`` without waiting; ``None``: nothing yet (or
    no non-waiting read on this platform)."""
    if not _DONTWAIT:
        return None
    try:
        return sock.recv_into(view, len(view), _DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None


_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)  # Linux, macOS; not Windows


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None,
               stall: Optional[float] = None, begun: bool = False) -> bytes:
    """Read exactly ``n`` bytes or raise ``ConnectionError`` on EOF (``socket.timeout`` once the
    ``time.monotonic()`` ``deadline`` has passed, however slowly the peer trickles bytes).

    ``stall``: raise :class:`MessageStalled` when no byte comes for that long once the read has
    begun (after its first byte; from the start if ``begun``: the message began earlier)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("handshake deadline passed")
            sock.settimeout(left)
        elif stall is not None and (got or begun):
            k = _recv_now(sock, view[got:])  # usually the rest is here: no poll, no wait
            if k is None and not _readable(sock, stall):
                raise MessageStalled(f"the peer sent part of a message, then nothing for "
                                     f"{stall:g} s")
        k = sock.recv_into(view[got:], n - got) if k is None else k
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, key: bytes,
                     timeout: float = HANDSHAKE_TIMEOUT) -> Dict[str, Any]:
    """Authenticate a freshly accepted connection; return the peer's hello (a small JSON dict).

    The whole exchange must finish within ``timeout`` seconds."""
    return accept_session(sock, key, timeout)[0]


def accept_session(sock: socket.socket, key: bytes, timeout: float = HANDSHAKE_TIMEOUT,
                   protect: bool = False) -> Tuple[Dict[str, Any], Optional[Seal]]:
    """:func:`server_handshake` that also tells the peer whether the connection is protected;
    return the hello and the connection's :class:`~nbdist.wire.seal.Seal` (``None``: plain)."""
    deadline = time.monotonic() + timeout
    keepalive(sock)  # the controller's end: a rank's host that vanishes is noticed
    sock.settimeout(timeout)
    seal = None
    try:
        nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + nonce)
        reply = recv_exact(sock, len(MAGIC) + DIGEST + NONCE, deadline)
        if reply[:len(MAGIC)] != MAGIC:
            raise AuthenticationError("peer does not speak the nbdist protocol")
        mac, client_nonce = reply[len(MAGIC):len(MAGIC) + DIGEST], reply[len(MAGIC) + DIGEST:]
        if not hmac.compare_digest(mac, _mac(key, b"client", nonce)):
            raise AuthenticationError("peer does not hold the group key")
        mode = _SEALED if protect else _PLAIN
        sock.sendall(mode + _mac(key, b"server" + mode, client_nonce))
        if protect:
            seal = Seal(key, nonce, client_nonce, is_server=True)
            body = read_frame(sock, seal, lambda s, n: recv_exact(s, min(n, _MAX_HELLO), deadline))
        else:
            (size,) = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline))
            if size > _MAX_HELLO:
                raise AuthenticationError("hello message too large")
            body = recv_exact(sock, size, deadline)
        hello = json.loads(body.decode("utf-8"))
        if not isinstance(hello, dict):
            raise AuthenticationError("malformed hello")
    except (OSError, ValueError) as err:  # IntegrityError is an OSError (ConnectionError)
        raise AuthenticationError(f"handshake failed: {err}") from err
    sock.settimeout(None)
    return hello, seal


def client_handshake(sock: socket.socket, key: bytes, hello: Dict[str, Any],
                     timeout: float = HANDSHAKE_TIMEOUT) -> Optional[Seal]:
    """Prove we hold ``key``, check the server does too, then send ``hello``; return the
    connection's :class:`~nbdist.wire.seal.Seal` if the server protects it (else ``None``)."""
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    seal = None
    try:
        head = recv_exact(sock, len(MAGIC) + NONCE, deadline)
        if head[:len(MAGIC)] != MAGIC:
            raise AuthenticationError("server does not speak the nbdist protocol")
        my_nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + _mac(key, b"client", head[len(MAGIC):]) + my_nonce)
        try:
            answer = recv_exact(sock, 1 + DIGEST, deadline)
        except ConnectionError:
            raise AuthenticationError("the controller refused this connection: wrong group key "
                                      "(check --key-file)") from None
        mode = answer[:1]
        if mode not in (_PLAIN, _SEALED) or \
                not hmac.compare_digest(answer[1:], _mac(key, b"server" + mode, my_nonce)):
            raise AuthenticationError("server does not hold the group key")
        body = json.dumps(hello).encode("utf-8")
        if mode == _SEALED:
            seal = Seal(key, head[len(MAGIC):], my_nonce, is_server=False)
            sock.sendall(seal.frame(body))
        else:
            sock.sendall(_HEADER.pack(len(body)) + body)
    except OSError as err:
        raise AuthenticationError(f"handshake failed: {err}") from err
    sock.settimeout(None)
    return seal


def connect(address: Tuple[str, int], key: bytes, hello: Dict[str, Any]) -> socket.socket:
    """Open an authenticated connection to the controller at ``address`` (see
    :func:`connect_session` for one the controller may protect)."""
    return connect_session(address, key, hello)[0]


def connect_session(address: Tuple[str, int], key: bytes,
                    hello: Dict[str, Any]) -> Tuple[socket.socket, Optional[Seal]]:
    """Open an authenticated connection; return it and its :class:`~nbdist.wire.seal.Seal`
    (``None`` unless the controller protects the connection)."""
    sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        return sock, client_handshake(sock, key, hello)
    except BaseException:
        sock.close()
        raise


def open_channel(address: Tuple[str, int], key: bytes, hello: Dict[str, Any]) -> "Channel":
    """A control :class:`Channel` to the controller, protected if the controller says so."""
    return Channel(*connect_session(address, key, hello))


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host`` only (loopback and a free port by default)."""
    return socket.create_server((host, port), backlog=256)


class Channel:
    """Length-prefixed pickle messages over an authenticated socket (thread-safe sends); sealed
    (:mod:`nbdist.wire.seal`) when ``seal`` is given: a message that fails its check raises
    :class:`~nbdist.wire.seal.IntegrityError`, the peer is told and the connection dropped."""

    def __init__(self, sock: socket.socket, seal: Optional[Seal] = None):
        self.sock = sock
        self.seal = seal
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = locks.make("channel")
        # a message half sent, half read (an interrupt hit): one flag per direction, as a
        # debugger's thread may send while another thread reads
        self._half_sent = self._half_read = False
        self.sent = 0  #: messages sent whole (an interrupt after the last byte still counts it)
        #: why the connection was given up ("" while it is fine): a protected message failed its
        #: check, the peer's host stopped answering (:data:`UNANSWERED`), or a message stalled
        self.failure = ""
        self.peer_silent = False  #: the failure is the peer's silence (its host is gone)
        self.stall = MESSAGE_STALL  #: s without a byte halfway through a message

    @property
    def torn(self) -> bool:
        """True while a message is half sent or half read (an interrupt hit it there): the
        channel cannot carry another one."""
        return self._half_sent or self._half_read

    def fileno(self) -> int:
        """The socket's file descriptor (so channels can be passed to ``select``)."""
        return self.sock.fileno()

    def send_bytes(self, data: bytes) -> None:
        """Send one framed message whose body is ``data``."""
        with self._send_lock:
            self._half_sent = True
            try:
                if self.seal is not None:
                    head, tail = self.seal.wrap(data)
                    if len(data) < 65536:
                        self.sock.sendall(head + data + tail)
                    else:
                        self.sock.sendall(head)
                        self.sock.sendall(data)
                        self.sock.sendall(tail)
                elif len(data) < 65536:
                    self.sock.sendall(_HEADER.pack(len(data)) + data)
                else:
                    self.sock.sendall(_HEADER.pack(len(data)))
                    self.sock.sendall(data)
            except TimeoutError as err:
                self._note_silence(err)
                raise
            self.sent += 1
            self._half_sent = False

    def recv_bytes(self) -> bytes:
        """Receive one framed message body (raises ``ConnectionError`` on EOF). Waits as long as
        it takes for a message to begin; once it has, :attr:`stall` bounds each pause."""
        self._half_read = True
        try:
            if self.seal is not None:
                begun = []

                def read(sock, n):
                    data = recv_exact(sock, n, stall=self.stall, begun=bool(begun))
                    begun.append(True)
                    return data

                try:
                    data = read_frame(self.sock, self.seal, read)
                except IntegrityError as err:
                    self._drop(err)
                    raise
            else:  # the header waits as long as it takes; the body is bounded by the stall
                (size,) = _HEADER.unpack(recv_exact(self.sock, _HEADER.size, stall=self.stall))
                data = recv_exact(self.sock, size, stall=self.stall, begun=True)
        except TimeoutError as err:
            self._note_silence(err)
            raise
        self._half_read = False
        return data

    def _note_silence(self, err: TimeoutError) -> None:
        """A peer that went silent fails the connection: say why in :attr:`failure`."""
        if isinstance(err, MessageStalled):
            self.failure, self.peer_silent = self.failure or str(err), True
        elif err.errno == errno.ETIMEDOUT:  # keepalive or TCP_USER_TIMEOUT gave up
            self.failure, self.peer_silent = self.failure or UNANSWERED, True

    def _drop(self, err: IntegrityError) -> None:
        """Tell the peer (unless it told us) and drop the connection: nothing more is read."""
        self.failure = str(err)
        if str(err) != seal_module.REFUSED_BY_PEER:
            if self._send_lock.acquire(timeout=1.0):  # a send stuck on a full socket: skip
                try:
                    self.sock.sendall(self.seal.frame(b""))
                except OSError:
                    pass
                finally:
                    self._send_lock.release()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def send(self, obj: Any) -> None:
        """Pickle ``obj`` and send it."""
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        """Receive and unpickle one message (only ever used on authenticated sockets; on a
        protected one, only after its tag was checked)."""
        return pickle.loads(self.recv_bytes())

    def close(self) -> None:
        """Close the socket (idempotent)."""
        try:
            self.sock.close()
        except OSError:
            pass


def encode(obj: Any) -> bytes:
    """Pickle a protocol message once, to send the same bytes to several ranks."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
