"""A rank of a ``keep_alive`` group whose controller is gone: it waits for a new one.

Without ``keep_alive`` a rank exits as soon as its controller (the notebook's kernel) is gone
(:mod:`.rankserver`'s watchdog). With it -- a group an engine launched with ``keep_alive=``, whose
config sets :data:`SECONDS` -- the rank keeps its process, its variables and its torch.distributed
state for that long:

* the watchdog points fds 1 and 2 at the launcher's log (the job's output file), so code still
  running prints there instead of into a closed connection, and notes that a call was running
  (:func:`lost`): its result is lost, and the next controller is told so (``lost_call``);
* the main thread, once its channel fails, tries every :data:`POLL` s to connect to the same
  address with the same key (:func:`await_controller`): ``nbdist.reattach()`` in a new kernel
  listens there. It answers the new controller's config with the ``ready`` report it sent first,
  and serves again with the same namespace;
* when :data:`SECONDS` pass with no controller, it exits (code :data:`EXPIRED`), and the engine's
  job ends with its ranks.

The rendezvous store of such a group is served by rank 0 (:func:`rank0_store`), not by the kernel:
``dist.new_group`` after a reattach needs a store, and the kernel that hosted the first one is gone.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

from ..wire import pump, transport

#: seconds a rank waits for a new controller once its controller is gone (``None``: it exits)
SECONDS: Optional[float] = None
POLL = 0.2  #: s between two tries to reach a new controller
EXPIRED = 0  #: the exit code of a rank whose keep_alive passed (the job ends normally)
STORE_KEY = "nbdist/rank0_store"  #: where rank 0 publishes its store's address (bootstrap store)


def kept() -> bool:
    """True while this rank outlives a lost controller (its group has ``keep_alive``)."""
    return SECONDS is not None


def lost(worker, lifeline) -> None:
    """Watchdog thread: the controller behind ``lifeline`` is gone. Output goes to the launcher's
    log until a new controller connects (unless a newer connection already replaced it)."""
    if lifeline is not worker.lifeline:
        return  # a try of await_controller that failed: the current streams are someone else's
    if worker.interrupts.running is not None:  # its result has no kernel to go to: say so later
        worker.lost_call = worker.interrupts.running
    log = getattr(worker, "launcher_stderr", None)
    if log is not None:
        for fd in (1, 2):
            try:
                os.dup2(log, fd)
            except OSError:
                pass
    _say(worker, f"lost the controller; keeping this rank, its variables and its process group "
                 f"for {SECONDS:g} s (keep_alive) for nbdist.reattach()")


def await_controller(worker, hello) -> transport.Channel:
    """Main thread, after its channel failed: the channel of a new controller once one listens
    at the group's address, or exit after :data:`SECONDS`."""
    global SECONDS
    deadline = time.monotonic() + float(SECONDS or 0)
    address, key = tuple(worker.cfg["address"]), worker.cfg["key"]
    while time.monotonic() < deadline:
        try:
            pump.abandon_pumps()  # the old streams' pumps end; new ones come with the streams
            from .worker_signals import Interrupts

            # the new controller numbers its requests from 1 again
            worker.interrupts = Interrupts(threading.main_thread().ident)
            worker.connect_streams()
            channel = transport.open_channel(address, key, dict(hello, reattach=True))
            kind, _, extra = channel.recv()
        except (OSError, EOFError, ValueError):
            time.sleep(POLL)
            continue
        if kind != "config":
            channel.close()
            time.sleep(POLL)
            continue
        SECONDS = extra.get("keep_alive") or None
        worker.channel = channel
        lost_call = getattr(worker, "lost_call", None)
        channel.send(("ready", -1, dict(worker.ready_report, reattached=True,
                                        lost_call=lost_call)))
        worker.lost_call = None
        _say(worker, "a new controller reattached")
        return channel
    _say(worker, f"no controller reattached within keep_alive ({SECONDS:g} s); exiting")
    pump.exit_now(EXPIRED)
    raise SystemExit(EXPIRED)  # not reached


def rank0_store(worker, boot: Any, world_size: int, timeout: float) -> Any:
    """The group's rendezvous store, served by rank 0 (a ``keep_alive`` group): rank 0 hosts a
    ``TCPStore`` on the address it reaches the controller from, and publishes it in ``boot`` (the
    controller's store, used for nothing else); the other ranks connect to it."""
    import torch.distributed as dist

    if worker.rank == 0:
        from .rendezvous import host_store

        host = worker.channel.sock.getsockname()[0]
        worker.own_store = host_store(host, world_size, timeout)
        boot.set(STORE_KEY, f"{host}:{worker.own_store.port}")
        return worker.own_store
    host, _, port = boot.get(STORE_KEY).decode().rpartition(":")
    return dist.TCPStore(host, int(port), world_size, is_master=False,
                         timeout=timedelta(seconds=timeout))


def _say(worker, text: str) -> None:
    log = getattr(worker, "launcher_stderr", None)
    if log is not None:
        try:
            os.write(log, f"nbdist.worker rank {worker.rank}: {text}.\n".encode())
        except OSError:
            pass
