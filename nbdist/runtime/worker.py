"""The worker process's entry points: a local worker (:func:`main`, started by the group) and
``python -m nbdist.worker`` (:func:`cli`, started by torchrun or srun for :func:`nbdist.attach`).

A worker is a fresh interpreter (a forkserver child with torch preloaded, or a spawned process). It

1. blocks SIGINT outside user code (:mod:`.worker_signals`), rebuilds its environment from the
   caller's (launcher variables such as ``SLURM_*`` removed, ``RANK``/``LOCAL_RANK``/... set),
2. connects its stdout and stderr -- the file descriptors themselves, so C++ output and the text of
   an abort reach the caller too (:mod:`.streams`: the sockets themselves, or pipes and a thread
   that forwards, signing in a protected group) -- and its control channel, each authenticated
   with the group key,
3. replaces ``sys.stdin`` with one that says there is none (what to do instead), registers
   custom backends, then calls ``init_process_group`` with an explicit timeout,
4. serves requests (:mod:`.rankserver`) until told to stop; it then destroys the process group
   before exiting.

A watchdog thread exits the process as soon as the controller's end of the connection goes away,
so workers never outlive a killed kernel.
"""
from __future__ import annotations

import atexit
import io
import os
import socket
import sys
import time
from typing import Any, Dict

import torch.distributed as dist

from ..wire import pump, transport
from . import orphan
from .rankserver import _failure, _flush_output, _Worker
from .worker_signals import sigint_ignored

def main(cfg: Dict[str, Any]) -> None:
    """Entry point of a local worker process (``cfg`` comes from :class:`nbdist.Group`)."""
    sigint_ignored()  # before any thread starts: they all inherit the blocked SIGINT
    getattr(os, "setpgid", lambda *_: None)(0, 0)  # the kernel's interrupt: via the lifeline only
    os.environ.clear()
    os.environ.update(cfg["env"])
    worker = _Worker(cfg)
    worker.connect_streams()
    channel = transport.open_channel(tuple(cfg["address"]), cfg["key"],
                                     {"rank": worker.rank, "role": "control", "pid": os.getpid()})
    _run(worker, channel)


class _NoStdin(io.TextIOBase):
    """A rank's ``sys.stdin``. Nothing can answer a rank's ``input()``: it runs in a worker
    process, not in the notebook. Reading says so (an ``EOFError``, as the end of input is, so
    code that handles that still works), and says how to get a value to the ranks instead."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> str:
        raise EOFError(f"rank {self.rank} has no stdin: input() and sys.stdin cannot read from "
                       "the notebook (the ranks are worker processes). Set the value in the "
                       "notebook and send it to the ranks: %dist_push name (or "
                       "g.push(name=value)), then use name on the ranks.")

    readline = read


def _run(worker: _Worker, channel: transport.Channel) -> None:
    sys.stdin = _NoStdin(worker.rank)  # the launcher's stdin is closed or /dev/null
    worker.channel = channel
    try:
        info = worker.init_dist()
    except BaseException as exc:  # noqa: BLE001 -- report, then exit
        _flush_output()
        channel.send(("init_err", -1, _failure(exc, worker.rank)))
        pump.exit_now(3)
    worker.ready_report = info  # sent again to a controller that reattaches (keep_alive)
    channel.send(("ready", -1, info))
    while True:
        try:
            worker.serve(channel)
            break
        except transport.IntegrityError as err:  # protected group: a tampered message
            worker.refuse(err)
        except (ConnectionError, OSError):
            if not orphan.kept():
                pump.exit_now(71)  # the controller is gone
            channel = orphan.await_controller(worker, getattr(worker, "hello", {}))
    try:
        dist.destroy_process_group()
        atexit._run_exitfuncs()  # user atexit handlers, multiprocessing's finalizers (semaphores)
    finally:
        _flush_output()
        pump.exit_now(0)


def _launcher_env(name: str, *fallbacks: str) -> int:
    for var in (name,) + fallbacks:
        if os.environ.get(var, "").strip():
            return int(os.environ[var])
    raise SystemExit(f"nbdist.worker: ${name} is not set: start this worker with torchrun "
                     "(which sets RANK and WORLD_SIZE) or srun (SLURM_PROCID, SLURM_NTASKS).")


def cli(argv=None) -> None:
    """``python -m nbdist.worker --connect HOST:PORT --key-file FILE``: a rank started by torchrun
    or srun joins the group a notebook opened with :func:`nbdist.attach`.

    Rank and world size come from the launcher's environment (``RANK``/``WORLD_SIZE`` from
    torchrun, ``SLURM_PROCID``/``SLURM_NTASKS`` from srun); the group key from a file, never from
    the command line.
    """
    import argparse

    ap = argparse.ArgumentParser(prog="python -m nbdist.worker", description=cli.__doc__.split("\n")[0])
    ap.add_argument("--connect", required=True, help="HOST:PORT the notebook listens on")
    ap.add_argument("--key-file", required=True, help="file holding the group key (hex)")
    args = ap.parse_args(argv)
    host, _, port = args.connect.rpartition(":")
    with open(args.key_file, encoding="ascii") as f:
        key = bytes.fromhex(f.read().strip())
    rank = _launcher_env("RANK", "SLURM_PROCID", "PMI_RANK")
    world = _launcher_env("WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or 0)
    sigint_ignored()  # before any thread starts: they all inherit the blocked SIGINT
    address = (host.strip("[]"), int(port))
    hello = {"rank": rank, "role": "control", "pid": os.getpid(), "world_size": world,
             "host": socket.gethostname(), "node": os.environ.get("GROUP_RANK")
             or os.environ.get("SLURM_NODEID") or "?"}
    cfg = {"rank": rank, "address": address, "key": key, "group_id": "remote", "shm": False}
    worker = _Worker(cfg)
    deadline = time.monotonic() + 60.0
    while True:  # the notebook may not be listening yet: retry for a minute
        try:
            worker.connect_streams()
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise SystemExit(f"nbdist.worker: nothing listens on {host}:{port}; run "
                                 "nbdist.attach() in the notebook first.") from None
            time.sleep(0.5)
    channel = transport.open_channel(address, key, hello)
    try:
        kind, _, extra = channel.recv()
    except transport.IntegrityError as err:
        worker.refuse(err)
    if kind != "config":
        pump.exit_now(72)
    cfg.update(extra, local_rank=local_rank, world_size=world)
    worker.hello = hello
    orphan.SECONDS = extra.get("keep_alive") or None  # an engine's group: may outlive the kernel
    for k, v in extra.get("env", {}).items():
        os.environ[k] = v
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    _run(worker, channel)


if __name__ == "__main__":
    from nbdist.runtime.worker import cli as _cli  # the real module, not a second copy as __main__

    _cli()
