"""What a rank does between start-up and exit: connect its streams, initialise torch.distributed,
serve ``run`` / ``exec`` / ``push`` / ``pull`` requests in a namespace that persists across calls.

The entry points that create a :class:`_Worker` (a local worker, or one started by torchrun/srun)
are in :mod:`.worker`; SIGINT handling is in :mod:`.worker_signals`.
"""
from __future__ import annotations

import _signal
import ast
import bdb
import ctypes
import importlib
import os
import re
import signal
import socket
import sys
import threading
import time
import types
from datetime import timedelta
from typing import Any, Dict, Optional

import cloudpickle
import torch
import torch.distributed as dist

from ..wire import pump, segments, serialize, transport
from ..wire import seal as seal_module
from ..wire.pool import SegmentPool
from ..wire.relay import ABORT_EXIT_CODE
from . import (cells, imports, orphan, postmortem, rankpdb, ranklog, recorder, sealed, stacks,
               streams)
from .worker_signals import SIGINT_MASK, SIGINT_SET, Interrupts, ignore_sigint, recv_whole

_COMMAND = re.compile(rb"([ISA])(\d+);")  # interrupt request n; stacks n (main / all threads)
_INIT_MSG = ("nbdist already initialised torch.distributed on this rank "
             "(backend {backend!r}, rank {rank} of {world}); use it as is -- there is no need to "
             "call init_process_group. To change the backend or world size, call "
             "restart(backend=..., world_size=...) on the group (or %dist_restart).")


class _Worker:
    def __init__(self, cfg: Dict[str, Any]):
        self.cfg = cfg
        self.rank = cfg["rank"]
        self.ns: Dict[str, Any] = {}
        self.cells = 0
        self.interrupts = Interrupts(threading.main_thread().ident)
        self.channel: Optional[transport.Channel] = None  # for the watchdog's stacks
        self.failure: Optional[BaseException] = None  # the last failed request's, until the next
        self.postmortem: Optional[postmortem.PostMortem] = None
        self.pool = SegmentPool(segments.shm_prefix(cfg["group_id"], f"r{self.rank}")) \
            if cfg["shm"] else None

    # ---- start-up -------------------------------------------------------------------------
    def connect_streams(self) -> None:
        if self.cfg["group_id"] == "remote" and not hasattr(self, "launcher_stderr"):
            self.launcher_stderr = os.dup(2)  # torchrun's/srun's log: the watchdog's last words
        self.lifeline, self.lifeline_seal = streams.connect(self.cfg)  # the stderr socket
        threading.Thread(target=self._watchdog, name="nbdist-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        # The controller's end of the stderr stream carries commands: "I<seq>;" interrupts request
        # seq in the main thread (SIGINT, as the notebook's interrupt button would; a request whose
        # code has not started yet is interrupted as it starts), "S<n>;" / "A<n>;" send the main
        # thread's / every thread's stack (:mod:`.stacks`), "K" kills this process,
        # "X" exits it with ABORT_EXIT_CODE (the group failed: the launcher must see a failure, not
        # wait in its exit barrier). EOF or an error means the controller is gone: exit at once,
        # never outlive it. Keepalive notices a controller host that vanished without a word.
        lifeline = self.lifeline  # a rank that outlives its controller gets new ones (orphan)
        transport.keepalive(lifeline)
        code, why = 70, ("lost the controller (the notebook's kernel exited or its host is "
                         "unreachable)")
        held = b""  # plain streams: the start of an "I<seq>;" (or "S<n>;") cut by recv()
        try:
            while True:
                if self.lifeline_seal is not None:  # protected: one sealed command per frame
                    data = seal_module.read_frame(lifeline, self.lifeline_seal,
                                                  transport.recv_exact)
                else:
                    data = lifeline.recv(64)
                if not data:
                    break
                data, held = held + data, b""
                if b"K" in data:  # no SIGKILL on Windows: SIGTERM there is TerminateProcess
                    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
                if b"X" in data:
                    code, why = ABORT_EXIT_CODE, ("the controller ended this rank: its group "
                                                  "failed (another rank died or was killed)")
                    break
                commands = _COMMAND.findall(data)
                start = max(data.rfind(b"I"), data.rfind(b"S"), data.rfind(b"A"))
                held = data[start:] if start >= 0 and b";" not in data[start:] else b""
                seqs = [int(n) for kind, n in commands if kind == b"I"]
                if seqs:
                    self.interrupts.request(max(seqs))
                for kind, n in commands:
                    if kind != b"I" and self.channel is not None:
                        stacks.send_later(self.channel, int(n), kind == b"A")
        except seal_module.IntegrityError as err:
            self.refuse(err)
        except (OSError, ValueError):  # the lifeline failed: exit
            pass
        if code != ABORT_EXIT_CODE and orphan.kept():  # keep_alive: wait for a new controller
            orphan.lost(self, lifeline)
            return
        if getattr(self, "launcher_stderr", None) is not None:
            try:
                os.write(self.launcher_stderr, f"nbdist.worker rank {self.rank}: {why}; exiting "
                                               f"with code {code}.\n".encode())
            except OSError:
                pass
        pump.exit_now(code)

    def refuse(self, err: BaseException) -> None:
        """A protected connection failed: say why on the launcher's log and to the caller, exit."""
        sealed.refuse(self.rank, err)

    def init_dist(self) -> Dict[str, Any]:
        cfg = self.cfg
        imports.from_env(rank=self.rank)  # NBDIST_PRELOAD: most often imported by the forkserver
        # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: read it again.
        dist.set_debug_level_from_env()
        for blob in cfg["custom_backends"]:
            cloudpickle.loads(blob).register_in_torch()
        # torch fixed its thread count when the forkserver imported it, before an OMP_NUM_THREADS
        # given in env= (nbdist then picks none) was set: apply it now.
        omp = os.environ.get("OMP_NUM_THREADS", "")
        threads = cfg["threads"] or (int(omp) if omp.isdigit() and int(omp) > 0 else None)
        if threads:
            torch.set_num_threads(threads)
        if cfg["backend"] == "auto" or cfg["device"] == "auto":  # attached ranks decide here
            from ..backends import resolve_backend

            choice = resolve_backend(cfg["backend"], cfg["device"])
            cfg["backend"], cfg["device"] = choice.backend, choice.device
            if choice.note:
                print(choice.note, file=sys.stdout)  # a note, not an error
        device, index = cfg["device"], cfg["local_rank"]
        if device == "cuda":  # ranks beyond the visible GPUs (max_world_size=) share them
            index %= max(1, torch.cuda.device_count())
            torch.cuda.set_device(index)
        if cfg.get("store_tcp"):
            host, port = cfg["store_tcp"]
            store = dist.TCPStore(host, port, cfg["world_size"], is_master=False,
                                  timeout=timedelta(seconds=cfg["timeout"]))
            if cfg.get("store_on_rank0"):  # keep_alive: the store outlives the controller
                store = orphan.rank0_store(self, store, cfg["world_size"], cfg["timeout"])
        else:
            store = dist.FileStore(cfg["store_path"], cfg["world_size"])
        dist.init_process_group(cfg["backend"], store=store, rank=self.rank,
                                world_size=cfg["world_size"],
                                timeout=timedelta(seconds=cfg["timeout"]))
        self._guard_init()
        recorder.install(dist)  # the rank's last collectives, for the stall analysis
        rankpdb.install(self)  # breakpoint() and pdb.set_trace() prompt in the notebook
        cells.keep_names_in_pdb()  # pdb on code from a cell finds the cell's lines
        for hook in cfg.get("rank_hooks", ()):  # e.g. Lightning's guards: an import hook only
            module, _, name = hook.partition(":")
            getattr(importlib.import_module(module), name)()
        self.ns.update({"__name__": "__main__", "__builtins__": __builtins__, "torch": torch,
                        "dist": dist, "rank": self.rank, "world_size": cfg["world_size"],
                        "device": torch.device(device, index) if device != "cpu"
                        else torch.device("cpu")})
        return {"pid": os.getpid(), "host": socket.gethostname(), "device": device,
                "node": os.environ.get("GROUP_RANK") or os.environ.get("SLURM_NODEID") or "0",
                "backend": str(dist.get_backend_config()), "threads": torch.get_num_threads(),
                "restarts": (int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
                             int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0))}

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
        # source, the name it runs under, where it starts in its cell (lines, columns), and
        # whether its text is its own (else the cell's came in a "src" message: cells.register)
        source, filename, lines, columns, own = payload
        tree = ast.parse(source, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        if own:
            cells.register({filename: source})
        cells.shift(tree, lines, columns)
        exec(compile(tree, filename, "exec"), self.ns)
        if last is not None:
            return eval(compile(cells.shift(last, lines, columns), filename, "eval"), self.ns)
        return None

    def do_push(self, payload: bytes):
        self.ns.update(serialize.loads(payload))

    def do_pull(self, names):
        missing = [n for n in names if n not in self.ns]
        if missing:
            raise NameError(f"name{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))} "
                            f"not defined on rank {self.rank}")
        return tuple(self.ns[n] for n in names)

    def do_debug(self, command: Optional[str]) -> str:
        """One pdb command on the kept failure (:mod:`.postmortem`); what pdb printed."""
        if self.failure is None:
            raise LookupError(postmortem.NOTHING_TO_DEBUG.format(rank=self.rank))
        if self.postmortem is None:
            self.postmortem = postmortem.PostMortem(self.failure)
        return self.postmortem.run(command)

    def receive(self, channel: transport.Channel, whole: bool = False):
        """The next message for this rank's main thread: the one reader of its control channel,
        for the serving loop and for pdb waiting for a command (:mod:`.rankpdb`; ``whole``: an
        interrupt may end the wait, never cut a message in half). Pooled result segments the
        caller gave back (``"free"``) are released here, and the text of the notebook cells the
        next request's code comes from (``"src"``) registered, whoever reads."""
        while True:
            kind, seq, payload = recv_whole(channel) if whole else channel.recv()
            if kind == "src":
                cells.register(payload)
            elif kind != "free":
                return kind, seq, payload
            elif self.pool is not None:
                self.pool.release(payload)

    def serve(self, channel: transport.Channel) -> None:
        handlers = {"run": self.do_run, "exec": self.do_exec, "push": self.do_push,
                    "pull": self.do_pull, "ping": lambda payload: None, "debug": self.do_debug}
        while True:
            kind, seq, payload = self.receive(channel)
            if kind == "stop":
                return
            if kind == "pdb_cmd":  # the answer to a prompt pdb asked twice (an interrupt came
                continue  # between its prompt and the read), after the call ended: dropped
            if kind != "debug":  # the next call: the last failure is forgotten
                self.failure = self.postmortem = None
            ranklog.begin(self.rank, ranklog.sender(channel, seq))
            try:
                reply = self._handle(handlers[kind], payload, seq)
            finally:
                ranklog.end()  # what the call logged goes before its reply
            _flush_output()
            counts = pump.sent_counts()  # protected: the caller waits for these frames
            if counts:
                channel.send(("sync", seq, counts, []))
            channel.send_bytes(reply)
            imports.run_pending()  # Group.preload: after the reply, before the next request

    def _handle(self, handler, payload, seq) -> bytes:
        error = None
        quiet = False
        try:
            try:
                self.interrupts.begin(seq)
                value = handler(payload)
            finally:
                self.interrupts.end()
                quiet = True
        except BaseException as exc:  # noqa: BLE001 -- every failure goes back to the caller
            error = exc  # an interrupt that cut the finally short is the call's too
        # Cut short, Python's default handler may still be installed and SIGINT unblocked: finish
        # inline (no Python function entered). The C call sets the mask before it runs pending
        # handlers, so a KeyboardInterrupt it raises was received before: after it none can come.
        while not quiet:
            try:
                # (without Interrupts' lock: a SIGINT the watchdog sends meanwhile is this
                # request's, and is dropped here or at the next begin)
                self.interrupts.running = None
                if SIGINT_MASK:
                    _signal.pthread_sigmask(_signal.SIG_BLOCK, SIGINT_SET)
                _signal.signal(_signal.SIGINT, ignore_sigint)
                quiet = True
            except KeyboardInterrupt:
                continue  # received before the mask: dropped, the call reports the first
        if error is not None:
            if handler != self.do_debug:
                self.failure = error  # kept for %dist_debug until the next request
            quit_text = (f"pdb was quit (q) on rank {self.rank}: the call ended there; the rank's "
                         "variables are kept") if isinstance(error, bdb.BdbQuit) else ""
            body = _failure(error, self.rank, quit_text)
            body["pg_gone"] = not dist.is_initialized()  # the call destroyed it, made no new one
            return transport.encode(("err", seq, body, []))
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
    """Describe an exception for the caller: type, message, traceback without nbdist's frames
    (:func:`.cells.format_failure`)."""
    formatted = text + "\n" if text else cells.format_failure(exc)
    try:
        blob = cloudpickle.dumps(exc)
    except Exception:  # noqa: BLE001 -- the exception itself may not be picklable
        blob = None
    return {"rank": rank, "type": type(exc).__name__, "message": text or str(exc),
            "traceback": formatted, "time": time.time(), "exception": blob,
            "pg_failed": process_group_failed(exc), "collective": recorder.raised()}


# gloo's transport errors: a pair that timed out or failed is closed for good (FACTS-TORCH.md
# §3.2). torch 2.13 raises them as a plain RuntimeError, so their text is the only sign of them.
_GLOO_PAIR_FAILURES = ("gloo/transport/", "Application timeout caused pair closure")
_TORCH_DISTRIBUTED = os.path.dirname(dist.__file__) + os.sep


def process_group_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) means this rank's process group can
    no longer be used: torch's ``DistBackendError`` (NCCL's errors and timeouts), or an error of
    gloo's transport raised inside torch.distributed (a collective that timed out or lost its
    peer). Errors raised in user code, and torch's own checks of arguments, are not."""
    for _ in range(8):  # the chain of causes, not forever
        if exc is None:
            return False
        if isinstance(exc, dist.DistBackendError):
            return True
        if isinstance(exc, RuntimeError) and _raised_in_torch_distributed(exc) and \
                any(text in str(exc) for text in _GLOO_PAIR_FAILURES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _raised_in_torch_distributed(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_TORCH_DISTRIBUTED)


def _flush_output() -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    if _libc is not None:
        _libc.fflush(None)
    pump.drain_pumps()  # streams through pipes: sent before the reply (no-op otherwise)


try:  # C's stdio buffers, flushed before a reply; on Windows the shared C runtime's
    _libc = ctypes.CDLL("ucrtbase" if sys.platform == "win32" else None)
    _libc.fflush.argtypes = [ctypes.c_void_p]
except (OSError, AttributeError, TypeError):  # pragma: no cover -- a platform without either
    _libc = None
