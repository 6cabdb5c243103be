"""The rendezvous an attached group hosts: a ``TCPStore`` on the one address the user chose.

torch binds a ``TCPStore`` server it makes itself to every interface (``::``), whatever host it is
given. Given a socket that is already listening (``master_listen_fd``, torch 2.13), it listens
there and nowhere else. So nbdist binds that socket itself, on the group's listen address, and
hands it over: "one address, never all interfaces" holds for every port nbdist opens. The store
owns the socket from then on and closes it when it is freed.
"""
from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

from ..wire import transport


def host_store(host: str, world_size: int, timeout: float) -> Any:
    """A ``TCPStore`` server for ``world_size`` ranks on ``host`` only, on a free port (its
    ``port`` attribute); ``timeout`` (s) bounds the ranks' waits on it."""
    import torch.distributed as dist

    sock = transport.listen(host, 0)
    try:
        store = dist.TCPStore(host, sock.getsockname()[1], world_size, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=float(timeout)),
                              master_listen_fd=sock.fileno(),
                              use_libuv=sys.platform != "win32")  # torch's Windows builds: no libuv
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes it: Python must not close the same number again
    return store
