"""Starting local worker processes and waiting until every rank is connected and initialised.

The caller owns everything shared: the control listener (loopback, port 0), the rendezvous (a
``FileStore`` in a private temp dir: no port at all, so no "address already in use" and nothing to
reach from outside), and the group key. Workers are fresh processes: forkserver children with
torch preloaded where the OS has forkserver, spawned interpreters elsewhere.

Workers never import the caller's ``__main__`` (multiprocessing normally re-runs the main script in
every child): code reaches them by value, so a script without an ``if __name__ == "__main__"`` guard
and a notebook behave the same.
"""
from __future__ import annotations

import os
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import cloudpickle

from ..wire import transport
from ..backends import BackendChoice
from ..errors import (DistTimeoutError, NbdistError, RankDiedError, RemoteError, RemoteFailure,
                      ranks_phrase)
from ..wire.relay import OutputPump
from .forkserver import main_hidden, mp_context, prewarm  # noqa: F401 -- prewarm: documented here


#: Run on every rank right after torch.distributed is initialised ("module:function" strings, so
#: the runtime does not import the layers above it). Lightning's guards only install an import hook:
#: Lightning itself is patched if and when code on the rank imports it.
RANK_HOOKS = ("nbdist.lightning.guards:install_hooks",)


def loopback_interface() -> Optional[str]:
    """The loopback interface's name ("lo", "lo0"), so gloo binds there and nowhere else."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


@dataclass
class Rank:
    """The caller's handle on one worker."""

    rank: int
    process: Any
    channel: Optional[transport.Channel] = None
    info: Optional[Dict[str, Any]] = None
    state: str = "starting"
    busy_with: str = ""
    since: Optional[float] = None
    last_error: str = ""
    pid: Optional[int] = None
    _exitcode: Optional[int] = None
    _released: bool = False

    @property
    def exitcode(self) -> Optional[int]:
        """The worker's exit code (negative: killed by that signal); ``None`` while it runs."""
        return self._exitcode if self._released else self.process.exitcode

    def release(self) -> None:
        """Free the process handle's pipes once the worker has exited (keeps its exit code)."""
        if not self._released and self.process.exitcode is not None:
            self._exitcode = self.process.exitcode
            self._released = True  # before close(): status() may read exitcode from a thread
            self.process.close()


def clean_environment(env: Dict[str, str]) -> Dict[str, str]:
    """Drop launcher variables that would mislead code on the ranks (SLURM, torchelastic, MPI)."""
    drop = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "LSB_", "JSM_", "MV2_")
    clean = {k: v for k, v in env.items() if not k.startswith(drop)}
    for k in ("GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME",
              "LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "NODE_RANK"):
        clean.pop(k, None)
    if clean.get("MPLBACKEND", "").startswith("module://"):
        clean["MPLBACKEND"] = "Agg"  # the kernel's inline backend needs IPython; ranks draw to files
    return clean


def rank_env(base: Dict[str, str], rank: int, world_size: int, port: int) -> Dict[str, str]:
    """The environment of rank ``rank``: the cleaned caller environment plus torch's variables."""
    env = clean_environment(base)
    env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "NODE_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    lo = loopback_interface()
    if lo and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = lo
    return env


def start_workers(group_id: str, choice: BackendChoice, world_size: int, timeout: float,
                  threads: Optional[int], env: Dict[str, str], store_path: str,
                  pump: OutputPump, init_timeout: float) -> List[Rank]:
    """Start ``world_size`` workers and return them once all are ready (or raise, leaving none)."""
    key = transport.new_key()
    listener = transport.listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    from .worker import main as worker_main  # imported here: `python -m nbdist.worker` stays clean

    ctx = mp_context()
    custom = custom_backend_blobs(choice)
    ranks: List[Rank] = []
    try:
        for r in range(world_size):
            cfg = {"rank": r, "world_size": world_size, "local_rank": r, "group_id": group_id,
                   "address": ("127.0.0.1", port), "key": key, "backend": choice.backend,
                   "device": choice.device, "timeout": timeout, "threads": threads,
                   "custom_backends": custom, "store_path": store_path, "shm": True,
                   "rank_hooks": RANK_HOOKS,
                   "env": rank_env(env, r, world_size, port)}
            proc = ctx.Process(target=worker_main, args=(cfg,), name=f"nbdist-{group_id}-rank{r}")
            with main_hidden():
                proc.start()
            ranks.append(Rank(r, proc, pid=proc.pid))
        _wait_ready(ranks, listener, key, pump, init_timeout)
    except BaseException:
        kill_all(ranks)
        for r in ranks:
            pump.wait_eof(r.rank, 0.5)
        raise
    finally:
        listener.close()
    return ranks


def _wait_ready(ranks: List[Rank], listener: socket.socket, key: bytes, pump: OutputPump,
                init_timeout: float) -> None:
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, ("listen", -1))
    for r in ranks:
        sel.register(r.process.sentinel, selectors.EVENT_READ, ("dead", r.rank))
    deadline = time.monotonic() + init_timeout
    failures: Dict[int, RemoteFailure] = {}
    dead: Dict[int, tuple] = {}
    try:
        while any(r.state != "idle" for r in ranks) and not failures and not dead:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r.rank for r in ranks if r.state != "idle"]
                raise DistTimeoutError(
                    f"{ranks_phrase(missing)} did not "
                    f"finish starting within {init_timeout:.0f} s (connected to the controller: "
                    f"{[r.rank for r in ranks if r.channel is not None]}). "
                    "Raise init_timeout=, or check the ranks' stderr above.", missing)
            for key_, _ in sel.select(remaining):
                what, idx = key_.data
                if what == "listen":
                    _accept(listener, key, ranks, pump, sel)
                elif what == "ctl":
                    _on_control(ranks[idx], sel, failures, dead)
                else:
                    ranks[idx].process.join(1.0)
                    dead[idx] = (ranks[idx].exitcode, "")
                    sel.unregister(key_.fileobj)
    finally:
        sel.close()
    _raise_start_failure(ranks, failures, dead, pump)


def _raise_start_failure(ranks: List[Rank], failures: Dict[int, RemoteFailure],
                         dead: Dict[int, tuple], pump: OutputPump) -> None:
    """Turn what went wrong while starting into one error naming every rank concerned."""
    if dead:
        for idx in dead:
            pump.wait_eof(idx, 1.0)
            dead[idx] = (dead[idx][0], pump.tail(idx))
        raise RankDiedError(dead, "while starting (before torch.distributed was initialised).",
                            "Nothing was left running; fix the cause and start the group again.")
    if failures:
        err = RemoteError(failures)
        absent = [r for r in ranks if r.state != "idle" and r.rank not in failures]
        why = "".join(
            f" Rank {r.rank} never got there ("
            + (f"still alive, pid {r.pid}: stuck before or inside the rendezvous"
               if r.exitcode is None else f"exit code {r.exitcode}") + ")."
            for r in absent)
        raise NbdistError(f"torch.distributed could not be initialised on "
                          f"{ranks_phrase(failures)}: "
                          f"{err.root_cause.type_name}: {err.root_cause.message}.{why}") from err


def _accept(listener, key, ranks, pump, sel) -> None:
    conn, _ = listener.accept()
    try:
        hello = transport.server_handshake(conn, key, timeout=5.0)
        rank, role = int(hello["rank"]), hello["role"]
        if not 0 <= rank < len(ranks) or role not in ("control", "stdout", "stderr"):
            raise transport.AuthenticationError(f"unexpected hello {hello!r}")
    except (transport.AuthenticationError, KeyError, ValueError, TypeError):
        conn.close()  # refuse quietly: nothing the peer sent was interpreted
        return
    if role == "control":
        ranks[rank].channel = transport.Channel(conn)
        sel.register(conn, selectors.EVENT_READ, ("ctl", rank))
    else:
        pump.add(rank, role, conn)


def _on_control(r: Rank, sel, failures, dead) -> None:
    try:
        kind, _, body = r.channel.recv()
    except (ConnectionError, OSError):
        r.process.join(1.0)
        dead[r.rank] = (r.exitcode, "")
        sel.unregister(r.channel.sock)
        return
    if kind == "ready":
        r.info, r.state = body, "idle"
    else:
        failures[r.rank] = failure_from(body)
    sel.unregister(r.channel.sock)


def failure_from(body: Dict[str, Any]) -> RemoteFailure:
    """Rebuild a :class:`RemoteFailure` from a worker's error report."""
    exc = None
    if body.get("exception") is not None:
        try:
            exc = cloudpickle.loads(body["exception"])
        except Exception:  # noqa: BLE001 -- an exception class we cannot import here
            exc = None
    return RemoteFailure(body["rank"], body["type"], body["message"], body["traceback"],
                         body["time"], exc)


def custom_backend_blobs(choice: BackendChoice) -> List[bytes]:
    """The custom backends of a backend choice, pickled for the workers."""
    return [cloudpickle.dumps(c) for c in choice.custom]


def kill_all(ranks: List[Rank]) -> None:
    """SIGKILL every worker still running and reap it."""
    for r in ranks:
        if r.exitcode is None:
            try:
                r.process.kill()
            except (OSError, ValueError, AttributeError):
                pass
    for r in ranks:
        if not r._released:
            r.process.join(5.0)
            r.release()
        if r.channel is not None:
            r.channel.close()


def cpu_limit() -> int:
    """The largest world size nbdist starts on this machine's CPUs without being told to."""
    return max(8, 4 * (os.cpu_count() or 1))
