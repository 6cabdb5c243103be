"""Per-message integrity for groups on a shared network: every message after the handshake carries
an HMAC-SHA256 tag (the idea of Jupyter's signed wire protocol), checked before it is interpreted.

Each connection derives two session keys from the group key and both handshake nonces, one per
direction, so a message cannot be reflected back to its sender or replayed on another connection.
Every tag covers a sequence number (so a message cannot be replayed, reordered or dropped within a
connection) and the message length. A frame is::

    8-byte length | 32-byte header tag | body | 32-byte body tag

The header tag is checked before the body is read (a forged length allocates nothing). A frame whose
tag does not match raises :class:`IntegrityError`; the connection is then dropped. An empty body is
never a message: it is the notice a side sends just before dropping a connection whose incoming
message failed its check, so the other side can say why too.

This gives integrity and authenticity, not secrecy: the contents remain readable on the path (see
docs/multinode.md for an SSH tunnel when that matters).
"""
from __future__ import annotations

import hmac
import struct
from hashlib import sha256
from typing import List, Optional

TAG = 32
_SIZE = struct.Struct("!Q")
HEAD = _SIZE.size + TAG
_SEQ = struct.Struct("!Q")
REFUSED_BY_US = ("a message failed its integrity check (tampered or corrupted in transit); the "
                 "connection was dropped")
REFUSED_BY_PEER = ("the other end refused a message sent to it: it failed its integrity check "
                   "there (tampered or corrupted in transit); the connection was dropped")
EXIT_TAMPERED = 73  #: exit code of a worker that refused a message from the controller


class IntegrityError(ConnectionError):
    """A protected message failed its integrity check (or the peer refused one of ours)."""


class Seal:
    """The session keys and sequence numbers of one protected connection (one per side).

    ``send`` side methods must be called under the sender's lock, ``recv`` side ones from one
    reader at a time.
    """

    def __init__(self, key: bytes, server_nonce: bytes, client_nonce: bytes, is_server: bool):
        c2s = hmac.new(key, b"nbdist-seal c2s" + server_nonce + client_nonce, sha256).digest()
        s2c = hmac.new(key, b"nbdist-seal s2c" + server_nonce + client_nonce, sha256).digest()
        self._send_key, self._recv_key = (s2c, c2s) if is_server else (c2s, s2c)
        self._send_seq = 0
        self._recv_seq = 0

    # ---- sending ---------------------------------------------------------------------------
    def wrap(self, data) -> tuple:
        """``(head, tail)`` to send around ``data`` (consumes one sequence number)."""
        seq = _SEQ.pack(self._send_seq)
        self._send_seq += 1
        size = _SIZE.pack(len(data))
        head = hmac.new(self._send_key, b"H" + seq + size, sha256).digest()
        body = hmac.new(self._send_key, b"B" + seq + size, sha256)
        body.update(data)
        return size + head, body.digest()

    def frame(self, data: bytes) -> bytes:
        """One whole frame around ``data`` (for small messages)."""
        head, tail = self.wrap(data)
        return head + data + tail

    # ---- receiving -------------------------------------------------------------------------
    def open_head(self, head: bytes) -> int:
        """Check a frame's first :data:`HEAD` bytes; return the body size."""
        size = head[:_SIZE.size]
        want = hmac.new(self._recv_key, b"H" + _SEQ.pack(self._recv_seq) + size, sha256).digest()
        if not hmac.compare_digest(want, bytes(head[_SIZE.size:HEAD])):
            raise IntegrityError(REFUSED_BY_US)
        return _SIZE.unpack(size)[0]

    def open_body(self, size: int, body, tag: bytes) -> None:
        """Check a body against its tag (consumes one sequence number); an empty body is the
        peer's notice that it refused one of our messages."""
        mac = hmac.new(self._recv_key, b"B" + _SEQ.pack(self._recv_seq) + _SIZE.pack(size), sha256)
        mac.update(body)
        if not hmac.compare_digest(mac.digest(), bytes(tag)):
            raise IntegrityError(REFUSED_BY_US)
        self._recv_seq += 1
        if size == 0:
            raise IntegrityError(REFUSED_BY_PEER)


def read_frame(sock, seal: Seal, recv_exact) -> bytes:
    """Read and check one frame from a blocking socket; return its body."""
    size = seal.open_head(recv_exact(sock, HEAD))
    body = recv_exact(sock, size) if size else b""
    seal.open_body(size, body, recv_exact(sock, TAG))
    return body


class FrameReader:
    """Frames from a non-blocking stream, fed in whatever pieces arrive."""

    def __init__(self, seal: Seal):
        self.seal = seal
        self._buf = bytearray()
        self._size: Optional[int] = None

    def feed(self, data: bytes) -> List[bytes]:
        """The bodies completed by ``data`` (raises :class:`IntegrityError` on a bad frame)."""
        self._buf += data
        out = []
        while True:
            if self._size is None:
                if len(self._buf) < HEAD:
                    break
                self._size = self.seal.open_head(self._buf[:HEAD])
                del self._buf[:HEAD]
            if len(self._buf) < self._size + TAG:
                break
            body = bytes(self._buf[:self._size])
            self.seal.open_body(self._size, body, self._buf[self._size:self._size + TAG])
            del self._buf[:self._size + TAG]
            self._size = None
            out.append(body)
        return out
