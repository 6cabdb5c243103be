"""The worker process: connect to the controller, initialise torch.distributed, serve requests.

A worker is a fresh interpreter (a forkserver child with torch preloaded, or a spawned process). It

1. resets SIGINT to Python's default, rebuilds its environment from the caller's (launcher
   variables such as ``SLURM_*`` removed, ``RANK``/``LOCAL_RANK``/... set),
2. connects its stdout and stderr -- the file descriptors themselves, so C++ output and the text of
   an abort reach the caller too -- and its control channel, each authenticated with the group key,
3. registers custom backends, then calls ``init_process_group`` with an explicit timeout,
4. serves ``run`` / ``exec`` / ``push`` / ``pull`` requests in a namespace that persists across
   calls, until told to stop; it then destroys the process group before exiting.

A watchdog thread exits the process as soon as the controller's end of the connection goes away,
so workers never outlive a killed kernel.
"""
from __future__ import annotations

import _signal
import ast
import atexit
import ctypes
import importlib
import linecache
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
from datetime import timedelta
from typing import Any, Dict

import cloudpickle
import torch
import torch.distributed as dist

from ..wire import segments, serialize, transport
from ..wire.pool import SegmentPool
from . import imports, ranklog

_INIT_MSG = ("nbdist already initialised torch.distributed on this rank "
             "(backend {backend!r}, rank {rank} of {world}); use it as is -- there is no need to "
             "call init_process_group. To change the backend or world size, call "
             "restart(backend=..., world_size=...) on the group (or %dist_restart).")


def _ignore_sigint(signum, frame):
    """SIGINT outside user code (while talking to the controller) is ignored: no torn messages."""


# SIGINT reaches a rank's main thread only while the user's code runs (Python's default handler
# then raises KeyboardInterrupt). The rest of the time it is blocked in the main thread -- and in
# every thread started at start-up, which inherit the mask -- and ignored: a stray interrupt (a
# burst from the notebook's interrupt button, one that lands as a call ends) can never kill the
# rank or tear a message. Where it matters the C functions of ``_signal`` are called, not
# ``signal``'s Python wrappers: entering a Python function is a point where CPython runs the
# handlers of signals already received.
_SIGINT = {_signal.SIGINT}
_SIGMASK = hasattr(_signal, "pthread_sigmask")  # not on Windows


def _sigint_ignored() -> None:
    """SIGINT blocked in this thread (and in the threads it starts from now on), then ignored.
    Once the mask is set only an interrupt received before can still be raised."""
    if _SIGMASK:
        _signal.pthread_sigmask(_signal.SIG_BLOCK, _SIGINT)
    _signal.signal(_signal.SIGINT, _ignore_sigint)


def _sigint_to_user() -> None:
    """Before the user's code: interrupts that came while the rank was idle are dropped (they are
    delivered as SIGINT is unblocked, still to the ignoring handler), then SIGINT raises
    KeyboardInterrupt."""
    if _SIGMASK:
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _SIGINT)
    _signal.signal(_signal.SIGINT, signal.default_int_handler)


class _Worker:
    def __init__(self, cfg: Dict[str, Any]):
        self.cfg = cfg
        self.rank = cfg["rank"]
        self.ns: Dict[str, Any] = {}
        self.cells = 0
        self.pool = SegmentPool(segments.shm_prefix(cfg["group_id"], f"r{self.rank}")) \
            if cfg["shm"] else None

    # ---- start-up -------------------------------------------------------------------------
    def connect_streams(self) -> None:
        address = tuple(self.cfg["address"])
        key = self.cfg["key"]
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            sock = transport.connect(address, key, {"rank": self.rank, "role": stream,
                                                    "pid": os.getpid()})
            sys.stdout.flush() if fd == 1 else sys.stderr.flush()
            os.dup2(sock.fileno(), fd)
            if fd == 2:
                self.lifeline = sock  # keep one end for the watchdog
            else:
                sock.close()
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                          closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                          closefd=False)
        threading.Thread(target=self._watchdog, name="nbdist-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        # The controller's end of the stderr stream carries one-byte commands: "I" interrupts the
        # main thread (SIGINT, as the notebook's interrupt button would), "K" kills this process.
        # EOF or an error means the controller is gone: exit at once, never outlive it.
        main_id = threading.main_thread().ident
        try:
            while True:
                data = self.lifeline.recv(64)
                if not data:
                    break
                if b"K" in data:
                    os.kill(os.getpid(), signal.SIGKILL)
                if b"I" in data:
                    signal.pthread_kill(main_id, signal.SIGINT)
        except OSError:
            pass
        os._exit(70)

    def init_dist(self) -> Dict[str, Any]:
        cfg = self.cfg
        # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: read it again.
        dist.set_debug_level_from_env()
        for blob in cfg["custom_backends"]:
            cloudpickle.loads(blob).register_in_torch()
        if cfg["threads"]:
            torch.set_num_threads(cfg["threads"])
        if cfg["backend"] == "auto" or cfg["device"] == "auto":  # attached ranks decide here
            from ..backends import resolve_backend

            choice = resolve_backend(cfg["backend"], cfg["device"])
            cfg["backend"], cfg["device"] = choice.backend, choice.device
            if choice.note:
                print(choice.note, file=sys.stderr)
        device = cfg["device"]
        if device == "cuda":
            torch.cuda.set_device(cfg["local_rank"])
        if cfg.get("store_tcp"):
            host, port = cfg["store_tcp"]
            store = dist.TCPStore(host, port, cfg["world_size"], is_master=False,
                                  timeout=timedelta(seconds=cfg["timeout"]))
        else:
            store = dist.FileStore(cfg["store_path"], cfg["world_size"])
        dist.init_process_group(cfg["backend"], store=store, rank=self.rank,
                                world_size=cfg["world_size"],
                                timeout=timedelta(seconds=cfg["timeout"]))
        self._guard_init()
        for hook in cfg.get("rank_hooks", ()):  # e.g. Lightning's guards: an import hook only
            module, _, name = hook.partition(":")
            getattr(importlib.import_module(module), name)()
        self.ns.update({"__name__": "__main__", "__builtins__": __builtins__, "torch": torch,
                        "dist": dist, "rank": self.rank, "world_size": cfg["world_size"],
                        "device": torch.device(device, cfg["local_rank"]) if device != "cpu"
                        else torch.device("cpu")})
        return {"pid": os.getpid(), "host": socket.gethostname(), "device": device,
                "node": os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or "0",
                "backend": str(dist.get_backend_config()), "threads": torch.get_num_threads()}

    def _guard_init(self) -> None:
        original = dist.init_process_group
        msg = _INIT_MSG.format(backend=self.cfg["backend"], rank=self.rank,
                               world=self.cfg["world_size"])

        def init_process_group(*args, **kwargs):
            if dist.is_initialized():
                raise RuntimeError(msg)
            return original(*args, **kwargs)

        init_process_group.__doc__ = original.__doc__
        dist.init_process_group = init_process_group

    # ---- requests ---------------------------------------------------------------------------
    def do_run(self, payload: bytes):
        fn, args, kwargs = serialize.loads(payload)
        return self._with_namespace(fn)(*args, **kwargs)

    def _with_namespace(self, fn):
        """A notebook function sees the rank's namespace for names it did not bring along.

        cloudpickle ships the globals a ``__main__`` function uses that existed in the kernel, in
        one dict shared by the functions of that payload (helpers it calls included). The rank's
        names are added to that dict where the kernel had none (e.g. a ``model`` made with
        ``exec`` on the ranks). Assignments to globals inside the function stay in that dict.
        """
        if isinstance(fn, types.FunctionType) and fn.__module__ == "__main__":
            scope = fn.__globals__
            for name, value in self.ns.items():
                scope.setdefault(name, value)
        return fn

    def do_exec(self, payload):
        source, filename = payload
        tree = ast.parse(source, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            return eval(compile(last, filename, "eval"), self.ns)
        return None

    def do_push(self, payload: bytes):
        self.ns.update(serialize.loads(payload))

    def do_pull(self, names):
        missing = [n for n in names if n not in self.ns]
        if missing:
            raise NameError(f"name{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
                            f"not defined on rank {self.rank}")
        return tuple(self.ns[n] for n in names)

    def serve(self, channel: transport.Channel) -> None:
        handlers = {"run": self.do_run, "exec": self.do_exec, "push": self.do_push,
                    "pull": self.do_pull, "ping": lambda payload: None}
        while True:
            kind, seq, payload = channel.recv()
            if kind == "stop":
                return
            if kind == "free":  # the caller released pooled result segments
                if self.pool is not None:
                    self.pool.release(payload)
                continue
            ranklog.begin(self.rank, ranklog.sender(channel, seq))
            try:
                reply = self._handle(handlers[kind], payload, seq)
            finally:
                ranklog.end()  # what the call logged goes before its reply
            _flush_output()
            channel.send_bytes(reply)
            imports.run_pending()  # Group.preload: after the reply, before the next request

    def _handle(self, handler, payload, seq) -> bytes:
        error = None
        quiet = False
        try:
            try:
                _sigint_to_user()
                value = handler(payload)
            finally:
                _sigint_ignored()
                quiet = True
        except BaseException as exc:  # noqa: BLE001 -- every failure goes back to the caller
            error = exc  # an interrupt that cut the finally short is the call's too
        # Cut short, Python's default handler may still be installed and SIGINT unblocked: finish
        # inline (no Python function entered). The C call sets the mask before it runs pending
        # handlers, so a KeyboardInterrupt it raises was received before: after it none can come.
        while not quiet:
            try:
                if _SIGMASK:
                    _signal.pthread_sigmask(_signal.SIG_BLOCK, _SIGINT)
                _signal.signal(_signal.SIGINT, _ignore_sigint)
                quiet = True
            except KeyboardInterrupt:
                continue  # received before the mask: dropped, the call reports the first
        if error is not None:
            return transport.encode(("err", seq, _failure(error, self.rank), []))
        try:
            data, paths = serialize.dumps(value, None, pool=self.pool)
        except Exception as exc:  # noqa: BLE001 -- e.g. a lock, a generator, an open file
            text = (f"the result on rank {self.rank} ({type(value).__module__}."
                    f"{type(value).__qualname__}) could not be pickled to send it back: "
                    f"{type(exc).__name__}: {exc}. Return something picklable, or keep the "
                    "object on the rank (assign it in exec) and pull what you need.")
            return transport.encode(("err", seq, _failure(exc, self.rank, text), []))
        return transport.encode(("ok", seq, data, paths))


def _failure(exc: BaseException, rank: int, text: str = "") -> Dict[str, Any]:
    """Describe an exception for the caller: type, message, traceback without nbdist's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, serialize.__file__):
        tb = tb.tb_next
    formatted = text + "\n" if text else "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        blob = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 -- the exception itself may not be picklable
        blob = None
    return {"rank": rank, "type": type(exc).__name__, "message": text or str(exc),
            "traceback": formatted, "time": time.time(), "exception": blob}


def _flush_output() -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if _libc is not None:
        _libc.fflush(None)


try:
    _libc = ctypes.CDLL(None)
    _libc.fflush.argtypes = [ctypes.c_void_p]
except (OSError, AttributeError):  # pragma: no cover -- Windows
    _libc = None


def main(cfg: Dict[str, Any]) -> None:
    """Entry point of a local worker process (``cfg`` comes from :class:`nbdist.Group`)."""
    _sigint_ignored()  # before any thread starts: they all inherit the blocked SIGINT
    getattr(os, "setpgid", lambda *_: None)(0, 0)  # the kernel's interrupt: via the lifeline only
    os.environ.clear()
    os.environ.update(cfg["env"])
    worker = _Worker(cfg)
    worker.connect_streams()
    channel = transport.Channel(transport.connect(tuple(cfg["address"]), cfg["key"],
                                                  {"rank": worker.rank, "role": "control",
                                                   "pid": os.getpid()}))
    _run(worker, channel)


def _run(worker: _Worker, channel: transport.Channel) -> None:
    try:
        info = worker.init_dist()
    except BaseException as exc:  # noqa: BLE001 -- report, then exit
        _flush_output()
        channel.send(("init_err", -1, _failure(exc, worker.rank)))
        os._exit(3)
    channel.send(("ready", -1, info))
    try:
        worker.serve(channel)
    except (ConnectionError, OSError):
        os._exit(71)  # the controller is gone
    try:
        dist.destroy_process_group()
        atexit._run_exitfuncs()  # user atexit handlers, multiprocessing's finalizers (semaphores)
    finally:
        _flush_output()
        os._exit(0)


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
    _sigint_ignored()  # before any thread starts: they all inherit the blocked SIGINT
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
    channel = transport.Channel(transport.connect(address, key, hello))
    kind, _, extra = channel.recv()
    if kind != "config":
        os._exit(72)
    cfg.update(extra, local_rank=local_rank, world_size=world)
    for k, v in extra.get("env", {}).items():
        os.environ[k] = v
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    _run(worker, channel)


if __name__ == "__main__":
    from nbdist.runtime.worker import cli as _cli  # the real module, not a second copy as __main__

    _cli()
