"""Ranks on other hosts: the notebook listens, torchrun or srun starts ``python -m nbdist.worker``.

The caller opens the control listener on an address the user chose (loopback unless told
otherwise), writes the group key to a file readable only by its owner, prints the commands to run
on the nodes, and waits -- with a progress bar and a deadline -- until every rank has connected.
The rendezvous is a ``TCPStore`` hosted by the caller (torch binds it to all interfaces: the
documented trust model is "anyone who reaches the port can try; only key holders get in").
"""
from __future__ import annotations

import os
import selectors
import shlex
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

from ..wire import transport
from ..errors import DistTimeoutError, ranks_phrase
from .launcher import Rank, _on_control
from ..wire.relay import OutputPump


class RemoteProcess:
    """Stands in for ``multiprocessing.Process`` for a rank nbdist did not start itself.

    It has no sentinel: the rank is alive while its streams are connected. ``exitcode`` is
    ``None`` while connected, ``0`` after a clean stop and ``"lost"`` when the connection broke.
    """

    sentinel = None

    def __init__(self, rank: int, pid: int, host: str, pump: OutputPump):
        self.rank, self.pid, self.host, self._pump = rank, pid, host, pump
        self._gone = threading.Event()
        self._code = "lost"

    @property
    def exitcode(self):
        """``None`` while the rank is connected, else 0 or ``"lost"``."""
        return self._code if self._gone.is_set() else None

    def expect_exit(self) -> None:
        """We asked the rank to stop: its streams closing then means exit code 0."""
        self._code = 0

    def streams_closed(self) -> None:
        """The rank's streams reached EOF: it is gone."""
        self._gone.set()

    def kill(self) -> None:
        """Ask the worker's watchdog to SIGKILL its own process."""
        self._pump.send(self.rank, b"K")

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until the rank's streams are closed."""
        self._pump.wait_eof(self.rank, 3600.0 if timeout is None else timeout)
        if self._pump.eof_seen(self.rank):
            self._gone.set()

    def close(self) -> None:
        """Nothing to release (kept for the ``multiprocessing.Process`` interface)."""


def parse_listen(listen: str) -> Tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; the host must be given explicitly."""
    host, sep, port = str(listen).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"listen must look like 'HOST:PORT' (e.g. '10.0.0.5:0' or "
                         f"'127.0.0.1:29500'), got {listen!r}")
    if host in ("0.0.0.0", "::", ""):
        raise ValueError("listen on one address you chose, not on all interfaces "
                         f"({host!r}); use the address the nodes reach this machine at.")
    return host.strip("[]"), int(port)


def write_key(key: bytes, path: Optional[str]) -> str:
    """Write the hex key to ``path`` (or a new private temp file) with mode 0600; return the path."""
    if path is None:
        fd, path = tempfile.mkstemp(prefix="nbdist-key-", suffix=".hex")
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex())
    return path


def commands(host: str, port: int, key_file: str, world_size: int,
             nproc_per_node: Optional[int]) -> Dict[str, str]:
    """The commands that start the ranks on the nodes (torchrun and srun forms)."""
    nproc = nproc_per_node or world_size
    nnodes = max(1, -(-world_size // nproc))
    worker = (f"-m nbdist.worker --connect {host}:{port} --key-file {shlex.quote(key_file)}")
    return {
        "torchrun": (f"torchrun --nnodes={nnodes} --nproc-per-node={nproc} --rdzv-backend=c10d "
                     f"--rdzv-endpoint=<FIRST_NODE_HOST>:29400 {worker}"),
        "srun": f"srun --ntasks={world_size} --ntasks-per-node={nproc} python {worker}",
    }


def attach_workers(listener, key: bytes, world_size: int, config: Dict, pump: OutputPump,
                   join_timeout: float, progress: bool = True) -> Tuple[List[Rank], object]:
    """Wait for ``world_size`` remote ranks, send them ``config``, wait until all are ready."""
    import torch.distributed as dist

    host = listener.getsockname()[0]
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=config["timeout"]))
    config = dict(config, store_tcp=(host, store.port))
    ranks: Dict[int, Rank] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", -1))
    bar = _bar(world_size, progress)
    deadline = time.monotonic() + join_timeout
    failures: Dict = {}
    dead: Dict = {}
    try:
        while (len(ranks) < world_size or any(r.state != "idle" for r in ranks.values())) \
                and not failures and not dead:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in range(world_size) if r not in ranks
                           or ranks[r].state != "idle"]
                raise DistTimeoutError(
                    f"{ranks_phrase(missing)} did not "
                    f"join within {join_timeout:.0f} s; {len(ranks)} of {world_size} connected. "
                    "Check that the launcher command ran on every node and can reach this "
                    "address.", missing)
            for key_, _ in sel.select(remaining):
                what, idx = key_.data
                if what == "listen":
                    _accept_remote(listener, key, world_size, ranks, pump, sel, config, bar)
                else:
                    _on_control(ranks[idx], sel, failures, dead)
    finally:
        sel.close()
        if bar is not None:
            bar.close()
    if failures or dead:
        from .launcher import _raise_start_failure

        _raise_start_failure(list(ranks.values()), failures, dead, pump)
    return [ranks[r] for r in range(world_size)], store


def _accept_remote(listener, key, world_size, ranks, pump, sel, config, bar) -> None:
    conn, _ = listener.accept()
    try:
        hello = transport.server_handshake(conn, key, timeout=5.0)
        rank, role = int(hello["rank"]), hello["role"]
        if not 0 <= rank < world_size or role not in ("control", "stdout", "stderr"):
            raise transport.AuthenticationError(f"unexpected hello {hello!r}")
        if role == "control" and int(hello.get("world_size", world_size)) != world_size:
            print(f"nbdist: refused rank {rank} from {hello.get('host')}: it was started with "
                  f"WORLD_SIZE={hello.get('world_size')}, this group expects {world_size}.",
                  file=sys.stderr)
            raise transport.AuthenticationError("world size mismatch")
    except (transport.AuthenticationError, KeyError, ValueError, TypeError):
        conn.close()
        return
    if (role == "control" and rank in ranks) or (role != "control" and pump.has(rank, role)):
        print(f"nbdist: refused a second rank {rank} ({role}) from {hello.get('host')}: that "
              "rank has already joined (was the launcher command run twice?).", file=sys.stderr)
        conn.close()
        return
    if role != "control":
        pump.add(rank, role, conn)
        return
    proc = RemoteProcess(rank, int(hello.get("pid", 0)), str(hello.get("host", "?")), pump)
    r = Rank(rank, proc, channel=transport.Channel(conn), pid=proc.pid)
    ranks[rank] = r
    r.channel.send(("config", -1, config))
    sel.register(conn, selectors.EVENT_READ, ("ctl", rank))
    if bar is not None:
        bar.update(1)


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="ranks joined", unit="rank")
