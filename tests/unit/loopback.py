"""Helpers for wire tests: real loopback TCP connections (never a fake socket)."""
import socket


def tcp_pair():
    """The two ends ``(accepted, connecting)`` of a real loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        b = socket.create_connection(listener.getsockname())
        a, _ = listener.accept()
    return a, b
