"""``Group``: a persistent set of worker processes with torch.distributed initialised.

Calls are synchronous: the same request goes to every chosen rank and the caller waits for all
replies while watching each worker's process sentinel. So a rank that dies is reported at once
(:class:`RankDiedError`), a deadline gives :class:`DistTimeoutError`, and Ctrl-C / the notebook's
interrupt button interrupts the ranks (SIGINT), kills those still blocked after a short grace
period, and raises :class:`GroupInterrupted`. A Python error on a rank raises :class:`RemoteError`
with the remote traceback and leaves the group usable.
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue
import secrets
import selectors
import shutil
import socket
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..wire import pool as shmpool, segments, serialize, transport
from . import launcher
from ..backends import BackendChoice, resolve_backend
from ..errors import GroupClosedError
from .calls import CallEngine
from ..wire.relay import OutputPump, Sink
from .status import GroupStatus, RankStatus

_live: "weakref.WeakSet[Group]" = weakref.WeakSet()
_notes_said: set = set()
started_ids: set = set()  # ids of every group started in this process (leak checks use them)
_current: Optional["Group"] = None


def current_group() -> Optional["Group"]:
    """The group the magics and widgets use, or ``None``.

    A group started with :func:`start` / :func:`attach` (or ``%dist_start``, or the launcher
    widget) becomes current when no other group is running; :func:`use_group` picks one.
    Code, magics and widgets that call this share one object.
    """
    return _current


def use_group(group: Optional["Group"]) -> None:
    """Make ``group`` the current group (``None`` detaches)."""
    global _current
    if group is not None and not isinstance(group, Group):
        raise TypeError(f"use_group() takes an nbdist.Group (or None), got {type(group).__name__}")
    _current = group


def _say_once(note: Optional[str]) -> None:
    if note and note not in _notes_said:
        _notes_said.add(note)
        import sys

        print(note, file=sys.stderr)


class Group(CallEngine):
    """A persistent group of ``world_size`` worker processes with torch.distributed initialised.

    Args:
        world_size: number of ranks (processes) to start.
        backend: ``"auto"`` (see :func:`nbdist.resolve_backend`), a backend name, a registered custom
            backend, or a mapping string such as ``"cpu:gloo,cuda:nccl"``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (rank r then uses ``cuda:r``).
        timeout: torch.distributed's process-group timeout in seconds (collectives that wait longer
            fail); also bounds the rendezvous. torch's own default is 30 minutes.
        call_timeout: default deadline in seconds for every call (``None``: no deadline).
        init_timeout: how long to wait for all ranks to be ready (default: ``timeout``).
        threads: torch intra-op threads per rank. Default: the machine's cores divided among the
            ranks (at least 1), as torchrun does; nbdist says so when it lowers torch's default.
        env: extra environment variables for the ranks.
        debug: set ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on the ranks (explains collective mismatches,
            about 3x slower small collectives).
        grace: seconds a rank gets to react to SIGINT before it is killed.
        auto_restart: restart the group by itself after a failure that broke it.
        output: ``sink(rank, stream, text)`` receiving the ranks' output lines.
        max_world_size: raise the CPU sanity limit on ``world_size``.
    """

    def __init__(self, world_size: int = 2, backend: Optional[str] = "auto",
                 device: Optional[str] = "auto", timeout: float = 60.0, *,
                 call_timeout: Optional[float] = None, init_timeout: Optional[float] = None,
                 threads: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 debug: bool = False, grace: float = 0.5, auto_restart: bool = False,
                 output: Optional[Sink] = None, max_world_size: Optional[int] = None,
                 _remote: Optional[Dict[str, Any]] = None):
        self.id = secrets.token_hex(4)
        self._remote = _remote
        self._store = None
        self._lock = threading.RLock()
        self._seq = itertools.count(1)
        self._ranks: List[launcher.Rank] = []
        self._state = "new"
        self._tmp: Optional[str] = None
        self._pump: Optional[OutputPump] = None
        self._sel: Optional[selectors.BaseSelector] = None
        self.output = output
        self._opts: Dict[str, Any] = {}
        self._configure(world_size=world_size, backend=backend, device=device, timeout=timeout,
                        call_timeout=call_timeout, init_timeout=init_timeout, threads=threads,
                        env=env, debug=debug, grace=grace, auto_restart=auto_restart,
                        max_world_size=max_world_size)
        _live.add(self)
        started_ids.add(self.id)
        self._launch()
        if _current is None or _current.state == "stopped":
            use_group(self)

    # ---- configuration ------------------------------------------------------------------------
    def _configure(self, **opts) -> None:
        new = dict(self._opts)
        new.update(opts)
        ws = new["world_size"]
        if isinstance(ws, bool) or not isinstance(ws, int):
            raise TypeError(f"world_size must be an int, got {type(ws).__name__} ({ws!r})")
        if ws < 1:
            raise ValueError(f"world_size must be at least 1, got {ws}")
        for name in ("timeout", "call_timeout", "init_timeout", "grace"):
            v = new[name]
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        if new["threads"] is not None and (not isinstance(new["threads"], int) or new["threads"] < 1):
            raise ValueError(f"threads must be a positive int, got {new['threads']!r}")
        if self._remote is not None:
            # Remote ranks resolve "auto" on their own hardware; named backends are checked here.
            if new["backend"] in (None, "", "auto"):
                self._opts, self._choice = new, BackendChoice("auto", new["device"] or "auto")
                return
            choice = resolve_backend(new["backend"], "cpu" if new["device"] in (None, "auto")
                                     else new["device"])
            self._opts, self._choice = new, choice
            return
        choice = resolve_backend(new["backend"], new["device"])
        limit = new["max_world_size"] or (launcher.cpu_limit() if choice.device == "cpu" else None)
        if choice.device == "cuda":
            import torch

            limit = new["max_world_size"] or torch.cuda.device_count()
        if limit is not None and ws > limit:
            raise ValueError(
                f"world_size={ws} is more than this machine runs well on device "
                f"{choice.device!r} (limit {limit}: "
                f"{'one rank per GPU' if choice.device == 'cuda' else '4 ranks per CPU core'}). "
                "Use a smaller world size, or pass max_world_size= to raise the limit.")
        self._opts = new
        self._choice = choice

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._opts["world_size"]

    @property
    def backend(self) -> str:
        """The backend the ranks use (after resolution of ``"auto"``)."""
        return self._choice.backend

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self._choice.device

    @property
    def timeout(self) -> float:
        """torch.distributed's process-group timeout on the ranks, in seconds."""
        return float(self._opts["timeout"])

    @property
    def state(self) -> str:
        """``"ready"``, ``"busy"``, ``"broken"`` (restart needed) or ``"stopped"``."""
        return self._state

    # ---- lifecycle ----------------------------------------------------------------------------
    def _launch(self) -> None:
        o = self._opts
        _say_once(self._choice.note)
        threads = o["threads"]
        cores = os.cpu_count() or 1
        if threads is None and "OMP_NUM_THREADS" not in os.environ and \
                "OMP_NUM_THREADS" not in (o["env"] or {}) and o["world_size"] > 1:
            threads = max(1, cores // o["world_size"])
            _say_once(f"nbdist: torch uses {threads} thread{'s' if threads > 1 else ''} per rank "
                      f"({cores} cores shared by {o['world_size']} ranks); pass threads= to change.")
        env = dict(os.environ)
        env.update(o["env"] or {})
        if o["debug"]:
            env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        segments.sweep_orphans()
        self._tmp = tempfile.mkdtemp(prefix=f"nbdist-{self.id}-p{os.getpid()}-")
        self._pump = OutputPump(self._sink)
        try:
            if self._remote is not None:
                self._ranks = self._attach_ranks(threads, o)
            else:
                self._ranks = launcher.start_workers(
                    self.id, self._choice, o["world_size"], float(o["timeout"]), threads, env,
                    os.path.join(self._tmp, "store"), self._pump,
                    float(o["init_timeout"] or o["timeout"]))
        except BaseException:
            self._cleanup()
            self._state = "broken"
            raise
        self._freed: Dict[int, "queue.SimpleQueue[str]"] = {r.rank: queue.SimpleQueue()
                                                            for r in self._ranks}
        shmpool.set_release_hook(self.id, self._segment_freed)
        self._sel = selectors.DefaultSelector()
        for r in self._ranks:
            self._sel.register(r.channel.sock, selectors.EVENT_READ, ("ctl", r.rank))
            if r.process.sentinel is not None:
                self._sel.register(r.process.sentinel, selectors.EVENT_READ, ("dead", r.rank))
        self._state = "ready"

    def _attach_ranks(self, threads, o) -> List[launcher.Rank]:
        from . import attach as remote

        rm = self._remote
        listener = transport.listen(*rm["address"])
        key = transport.new_key()
        try:
            host, port = listener.getsockname()[:2]
            key_file = remote.write_key(key, rm.get("key_file"))
            rm["key_file"], rm["commands"] = key_file, remote.commands(
                host, port, key_file, o["world_size"], rm.get("nproc_per_node"))
            if rm.get("progress", True):
                print(f"nbdist: waiting for {o['world_size']} ranks on {host}:{port} "
                      f"(key in {key_file}; copy it to the nodes, mode 0600). Start them with\n"
                      f"  {rm['commands']['torchrun']}\nor\n  {rm['commands']['srun']}")
            config = {"backend": self._choice.backend, "device": self._choice.device,
                      "timeout": float(o["timeout"]), "threads": threads,
                      "custom_backends": launcher.custom_backend_blobs(self._choice),
                      "rank_hooks": launcher.RANK_HOOKS,
                      "env": dict(o["env"] or {}, **({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
                                                      if o["debug"] else {}))}
            self._pump.on_eof = lambda rank: self._remote_gone(rank)
            ranks, self._store = remote.attach_workers(
                listener, key, o["world_size"], config, self._pump,
                float(rm.get("join_timeout", 600)), rm.get("progress", True))
            return ranks
        finally:
            listener.close()

    def _segment_freed(self, path: str) -> None:
        # Runs wherever the last tensor on a pooled segment dies (any thread, or the GC).
        rank = int(os.path.basename(path).split("-")[2][1:])
        freed = self._freed.get(rank)
        if freed is not None:
            freed.put(path)  # SimpleQueue.put is safe from finalizers and any thread

    def _remote_gone(self, rank: int) -> None:
        for r in self._ranks:
            if r.rank == rank and hasattr(r.process, "streams_closed"):
                r.process.streams_closed()

    def _sink(self, rank: int, stream: str, text: str) -> None:
        from ..wire.relay import default_sink

        (self.output or default_sink)(rank, stream, text)

    def restart(self, **changes) -> "Group":
        """Stop the workers and start fresh ones, with any option changed (``world_size=``,
        ``backend=``, ``device=``, ``timeout=``...). Per-rank variables are lost."""
        if self._remote is not None:
            raise GroupClosedError(
                "the ranks of an attached group were started by your launcher (torchrun/srun); "
                "nbdist cannot restart them. Call stop(), then nbdist.attach() again and re-run "
                "the launcher command.")
        unknown = set(changes) - set(self._opts)
        if unknown:
            raise TypeError(f"restart() got unknown option(s) {sorted(unknown)}; "
                            f"valid: {sorted(self._opts)}")
        with self._lock:
            self._configure(**changes)  # validate before stopping anything
            self._shutdown()
            self._launch()
        return self

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop every worker (process groups destroyed first) and release all resources.

        ``timeout``: how long to wait for a call running in another thread to finish; after it,
        the workers are killed instead (interpreter exit uses 5 s, so it never hangs).
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            launcher.kill_all(self._ranks)  # a call is stuck in another thread: no waiting
            return
        try:
            if self._state != "stopped":
                self._shutdown()
                self._state = "stopped"
        finally:
            self._lock.release()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))

    def __repr__(self) -> str:
        return (f"<nbdist.Group {self.id}: {self._state}, world_size={self.world_size}, "
                f"backend={self.backend!r}, device={self.device!r}>")

    def _shutdown(self) -> None:
        if self._pump is None:
            return  # already shut down
        stop_msg = transport.encode(("stop", 0, None))
        for r in self._ranks:
            if r.exitcode is None and r.channel is not None and r.state == "idle":
                try:
                    r.channel.send_bytes(stop_msg)
                    expect_exit = getattr(r.process, "expect_exit", None)  # remote ranks
                    if expect_exit is not None:
                        expect_exit()
                except OSError:
                    pass
            elif r.exitcode is None:
                r.process.kill()
        deadline = time.monotonic() + 2.0
        for r in self._ranks:
            if r.exitcode is None:
                r.process.join(max(0.0, deadline - time.monotonic()))
        launcher.kill_all(self._ranks)
        for r in self._ranks:
            self._pump.wait_eof(r.rank, 0.5)
            r.state = "stopped" if r.state != "dead" else "dead"
        self._cleanup()

    def _cleanup(self) -> None:
        if self._sel is not None:
            self._sel.close()
            self._sel = None
        if self._pump is not None:
            self._pump.drain(flush_partial=True)
            self._pump.close()
            self._pump = None
        shmpool.set_release_hook(self.id, None)
        segments.remove_segments(segments.leftover_segments(self.id))
        self._store = None
        if self._remote is not None and self._remote.get("key_file") and \
                self._remote.get("own_key_file"):
            segments.remove_segments([self._remote["key_file"]])
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # ---- calls --------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` may be a lambda, a closure or a function defined in the notebook: it travels by
        value (cloudpickle). Use :meth:`call` to pick ranks or set a deadline.
        """
        return self.call(fn, args, kwargs)

    def call(self, fn: Callable, args: Sequence = (), kwargs: Optional[Dict[str, Any]] = None,
             ranks: Optional[Iterable[int]] = None, timeout: Optional[float] = None) -> List[Any]:
        """Like :meth:`run`, on the chosen ``ranks`` (default all) and with a ``timeout`` (s)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        name = getattr(fn, "__qualname__", type(fn).__name__)
        payload, segments = self._pickle((fn, tuple(args), dict(kwargs or {})), f"function {name}")
        return self._call("run", payload, ranks, timeout, f"run {name}", segments)

    def exec(self, source: str, ranks: Optional[Iterable[int]] = None,
             timeout: Optional[float] = None) -> List[Any]:
        """Run Python ``source`` on the ranks, in a namespace that persists across calls.

        Returns each rank's value of the last expression (``None`` if the code ends with a
        statement). The namespace starts with ``torch``, ``dist``, ``rank``, ``world_size``, ``device``.
        """
        if not isinstance(source, str):
            raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
        filename = f"<dist-cell-{next(self._seq)}>"
        compile(source, filename, "exec")  # a SyntaxError shows here, with its line, no round trip
        return self._call("exec", (source, filename), ranks, timeout, "exec")

    def push(self, values: Optional[Dict[str, Any]] = None, /, *, ranks: Optional[Iterable[int]] = None,
             **kwargs) -> None:
        """Set variables in the ranks' namespaces: ``push(lr=0.1)`` or ``push({"x": t}, ranks=[0])``.

        CPU tensors travel through shared memory; every rank gets its own copy.
        """
        merged = dict(values or {})
        merged.update(kwargs)
        for name in merged:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"push() names must be valid identifiers, got {name!r}")
        payload, segments = self._pickle(merged, "pushed value")
        self._call("push", payload, ranks, None, f"push {', '.join(merged)}", segments)

    def pull(self, *names: str, ranks: Optional[Iterable[int]] = None) -> List[Any]:
        """Get variables from the ranks: one name -> ``[value_rank0, ...]``; several -> tuples."""
        if not names:
            raise ValueError("pull() needs at least one variable name, e.g. g.pull('loss')")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"pull() takes variable names, got {name!r}")
        values = self._call("pull", tuple(names), ranks, None, f"pull {', '.join(names)}")
        return [v[0] if len(names) == 1 else v for v in values]

    def _pickle(self, obj: Any, what: str):
        try:
            return serialize.dumps(obj, segments.shm_prefix(self.id, "c"), private=True,
                                   unlink=False)
        except Exception as err:  # noqa: BLE001 -- cloudpickle raises many types
            raise TypeError(f"cannot send the {what} to the ranks: it (or something it refers to) "
                            f"cannot be pickled: {type(err).__name__}: {err}. Define what it needs "
                            "on the ranks instead (e.g. with exec), or pass picklable data.") from err

    def _targets(self, ranks: Optional[Iterable[int]]) -> List[int]:
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        out = sorted(set(ranks))
        bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < self.world_size]
        if bad or not out:
            raise ValueError(f"ranks must be ints in 0..{self.world_size - 1}, got {list(ranks)!r}")
        return out

    def _check_usable(self) -> None:
        if self._state == "stopped":
            raise GroupClosedError("this group was stopped; start a new one with nbdist.start() "
                                   "or call restart() on it.")
        if self._state == "broken":
            if self._opts["auto_restart"]:
                self._shutdown()
                self._launch()
                return
            raise GroupClosedError("this group is broken after an earlier failure (see the error "
                                   "above); call restart() to start fresh workers.")

    # ---- status -------------------------------------------------------------------------------
    def status(self) -> GroupStatus:
        """Per-rank state (idle / busy with what since when / dead with exit code), pid, memory."""
        import psutil

        rows = []
        for r in self._ranks:
            info = r.info or {}
            rss = None
            state = r.state
            if r.exitcode is not None and state not in ("stopped",):
                state = "dead"
            elif state not in ("stopped", "dead") and \
                    info.get("host") in (None, socket.gethostname()):  # RSS only for local pids
                try:
                    rss = psutil.Process(r.pid).memory_info().rss
                except (psutil.Error, TypeError):
                    pass
            rows.append(RankStatus(r.rank, r.pid, info.get("host", "?"), info.get("device", "?"),
                                   info.get("backend", self.backend), state, r.busy_with if
                                   state == "busy" else "", r.since, r.exitcode, rss,
                                   r.last_error))
        return GroupStatus(self._state, self.world_size, self.backend, self.device, rows)


def start(world_size: int = 2, backend: Optional[str] = "auto", device: Optional[str] = "auto",
          timeout: float = 60.0, **options) -> Group:
    """Start a :class:`Group` of ``world_size`` ranks and return it once torch.distributed is ready.

    See :class:`Group` for the options. Use it as a context manager to stop it at the end.
    """
    return Group(world_size, backend, device, timeout, **options)


def attach(world_size: int, listen: str = "127.0.0.1:0", backend: Optional[str] = "auto",
           device: Optional[str] = "auto", timeout: float = 60.0, *, key_file: Optional[str] = None,
           join_timeout: float = 600.0, nproc_per_node: Optional[int] = None,
           progress: bool = True, **options) -> Group:
    """Open a group whose ``world_size`` ranks run elsewhere, started by torchrun or srun.

    The notebook listens on ``listen`` (``"HOST:PORT"``; an address you choose, never all
    interfaces), writes the group key to ``key_file`` (a new private temp file by default), prints
    the ``torchrun ... -m nbdist.worker --connect HOST:PORT --key-file FILE`` and ``srun`` commands,
    and returns once every rank has joined and initialised torch.distributed (or raises
    :class:`DistTimeoutError` after ``join_timeout`` seconds naming the missing ranks). Each rank
    takes its rank and world size from the launcher's environment. ``backend="auto"`` is resolved
    on the ranks' own hardware. The returned group works like a local one, except ``restart()``.
    """
    from .attach import parse_listen

    address = parse_listen(listen)
    remote = {"address": address, "key_file": key_file, "own_key_file": key_file is None,
              "join_timeout": join_timeout, "nproc_per_node": nproc_per_node, "progress": progress}
    return Group(world_size, backend, device, timeout, _remote=remote, **options)


def launch(fn: Callable, *args, world_size: int = 2, backend: Optional[str] = "auto",
           device: Optional[str] = "auto", **kwargs) -> List[Any]:
    """One shot: start a group, run ``fn(*args, **kwargs)`` on every rank, stop; return results."""
    with Group(world_size, backend, device) as group:
        return group.run(fn, *args, **kwargs)


def stop_all() -> None:
    """Stop every group still running in this process (also runs at interpreter exit)."""
    for group in list(_live):
        try:
            group.stop(timeout=5.0)
        except Exception:  # noqa: BLE001 -- exiting: stop the others regardless
            pass


atexit.register(stop_all)
