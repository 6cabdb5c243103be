"""The control channel between the caller and its workers: authentication and message framing.

Every connection starts with a mutual HMAC-SHA256 challenge on a per-group random key (the same idea
as ``multiprocessing.connection``), done on raw bytes with a deadline. Only after both sides proved
they hold the key is anything unpickled. Then messages travel as ``8-byte length + pickle``.

A failed or slow handshake raises :class:`AuthenticationError` and the socket is closed; the peer
learns nothing and nothing it sent is interpreted.
"""
from __future__ import annotations

import hmac
import json
import os
import pickle
import socket
import struct
import threading
import time
from hashlib import sha256
from typing import Any, Dict, Optional, Tuple

MAGIC = b"NBDIST01"
NONCE = 32
DIGEST = 32
_HEADER = struct.Struct("!Q")
_MAX_HELLO = 4096
HANDSHAKE_TIMEOUT = 10.0


class AuthenticationError(ConnectionError):
    """A peer failed the key challenge, sent malformed bytes, or took too long."""


def new_key() -> bytes:
    """A fresh random 32-byte group key."""
    return os.urandom(32)


def _mac(key: bytes, label: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, label + nonce, sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """Read exactly ``n`` bytes or raise ``ConnectionError`` on EOF (``socket.timeout`` once the
    ``time.monotonic()`` ``deadline`` has passed, however slowly the peer trickles bytes)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("handshake deadline passed")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, key: bytes,
                     timeout: float = HANDSHAKE_TIMEOUT) -> Dict[str, Any]:
    """Authenticate a freshly accepted connection; return the peer's hello (a small JSON dict).

    The whole exchange must finish within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    try:
        nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + nonce)
        reply = recv_exact(sock, len(MAGIC) + DIGEST + NONCE, deadline)
        if reply[:len(MAGIC)] != MAGIC:
            raise AuthenticationError("peer does not speak the nbdist protocol")
        mac, client_nonce = reply[len(MAGIC):len(MAGIC) + DIGEST], reply[len(MAGIC) + DIGEST:]
        if not hmac.compare_digest(mac, _mac(key, b"client", nonce)):
            raise AuthenticationError("peer does not hold the group key")
        sock.sendall(_mac(key, b"server", client_nonce))
        (size,) = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline))
        if size > _MAX_HELLO:
            raise AuthenticationError("hello message too large")
        hello = json.loads(recv_exact(sock, size, deadline).decode("utf-8"))
        if not isinstance(hello, dict):
            raise AuthenticationError("malformed hello")
    except (OSError, ValueError) as err:
        raise AuthenticationError(f"handshake failed: {err}") from err
    sock.settimeout(None)
    return hello


def client_handshake(sock: socket.socket, key: bytes, hello: Dict[str, Any],
                     timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Prove we hold ``key``, check the server does too, then send ``hello``."""
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    try:
        head = recv_exact(sock, len(MAGIC) + NONCE, deadline)
        if head[:len(MAGIC)] != MAGIC:
            raise AuthenticationError("server does not speak the nbdist protocol")
        my_nonce = os.urandom(NONCE)
        sock.sendall(MAGIC + _mac(key, b"client", head[len(MAGIC):]) + my_nonce)
        try:
            answer = recv_exact(sock, DIGEST, deadline)
        except ConnectionError:
            raise AuthenticationError("the controller refused this connection: wrong group key "
                                      "(check --key-file)") from None
        if not hmac.compare_digest(answer, _mac(key, b"server", my_nonce)):
            raise AuthenticationError("server does not hold the group key")
        body = json.dumps(hello).encode("utf-8")
        sock.sendall(_HEADER.pack(len(body)) + body)
    except OSError as err:
        raise AuthenticationError(f"handshake failed: {err}") from err
    sock.settimeout(None)


def connect(address: Tuple[str, int], key: bytes, hello: Dict[str, Any]) -> socket.socket:
    """Open an authenticated connection to the controller at ``address``."""
    sock = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client_handshake(sock, key, hello)
    return sock


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (loopback and a free port by default)."""
    sock = socket.create_server((host, port), backlog=256)
    return sock


class Channel:
    """Length-prefixed pickle messages over an authenticated socket (thread-safe sends)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self.torn = False  # True while a message is half sent or half read (an interrupt hit)

    def fileno(self) -> int:
        """The socket's file descriptor (so channels can be passed to ``select``)."""
        return self.sock.fileno()

    def send_bytes(self, data: bytes) -> None:
        """Send one framed message whose body is ``data``."""
        with self._send_lock:
            self.torn = True
            if len(data) < 65536:
                self.sock.sendall(_HEADER.pack(len(data)) + data)
            else:
                self.sock.sendall(_HEADER.pack(len(data)))
                self.sock.sendall(data)
            self.torn = False

    def recv_bytes(self) -> bytes:
        """Receive one framed message body (raises ``ConnectionError`` on EOF)."""
        self.torn = True
        (size,) = _HEADER.unpack(recv_exact(self.sock, _HEADER.size))
        data = recv_exact(self.sock, size)
        self.torn = False
        return data

    def send(self, obj: Any) -> None:
        """Pickle ``obj`` and send it."""
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        """Receive and unpickle one message (only ever used on authenticated sockets)."""
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
