"""``Group``: a persistent set of ranks with torch.distributed initialised, and the calls on it.

Calls are synchronous: the same request goes to every chosen rank and the caller waits for all
replies while watching each worker's process sentinel (see :mod:`nbdist.runtime.calls`). So a rank
that dies is reported at once (:class:`RankDiedError`), a deadline gives :class:`DistTimeoutError`,
and Ctrl-C / the notebook's interrupt button interrupts the ranks (SIGINT), kills those still
blocked after a short grace period, and raises :class:`GroupInterrupted`. A Python error on a rank
raises :class:`RemoteError` with the remote traceback and leaves the group usable.

The group is the only writer of its own state (``ready`` / ``busy`` / ``broken`` / ``stopped``);
see :mod:`nbdist.runtime` for which thread owns what.
"""
from __future__ import annotations

import contextvars
import itertools
import os
import secrets
import sys
import shutil
import tempfile
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from ..errors import GroupClosedError
from ..wire import pool as shmpool
from ..wire import segments, serialize
from ..wire.relay import OutputRelay, Sink, default_sink
from .calls import Call, settle
from .launcher import Launcher, LocalLauncher
from .ranks import Rank, RankSet
from .status import GroupStatus, check_options, collect_status

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
        print(note, file=sys.stderr)


class Group:
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
                 _launcher: Optional[Launcher] = None):
        self.id = secrets.token_hex(4)
        self._launcher = _launcher or LocalLauncher()
        self._store = None
        self._lock = threading.RLock()  # held by a call from send to settle, and by lifecycle
        self._seq = itertools.count(1)
        self._ranks: List[Rank] = []  # the current (or last) ranks, for status()
        self._rs: Optional[RankSet] = None  # the running ranks as a call sees them
        self._state = "new"
        self._stop_requested = False
        self._tmp: Optional[str] = None
        self._relay: Optional[OutputRelay] = None
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
    def _configure(self, **opts) -> None:  # validate everything before anything changes
        new = dict(self._opts)
        new.update(opts)
        check_options(new)
        self._choice = self._launcher.choose(new)
        self._opts = new

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
    def _threads(self) -> Optional[int]:
        o, cores = self._opts, os.cpu_count() or 1
        if o["threads"] is None and "OMP_NUM_THREADS" not in os.environ and \
                "OMP_NUM_THREADS" not in (o["env"] or {}) and o["world_size"] > 1:
            threads = max(1, cores // o["world_size"])
            _say_once(f"nbdist: torch uses {threads} thread{'s' if threads > 1 else ''} per rank "
                      f"({cores} cores shared by {o['world_size']} ranks); pass threads= to change.")
            return threads
        return o["threads"]

    def _launch(self) -> None:
        try:
            _say_once(self._choice.note)
            threads = self._threads()
            segments.sweep_orphans()
            self._tmp = tempfile.mkdtemp(prefix=f"nbdist-{self.id}-p{os.getpid()}-")
            self._relay = OutputRelay(self._sink)
            ranks, self._store = self._launcher.launch(self.id, self._choice, self._opts,
                                                       threads, self._tmp, self._relay)
            self._ranks, self._rs = ranks, RankSet(ranks, self._relay)
            shmpool.set_release_hook(self.id, self._segment_freed)
        except BaseException:
            self._cleanup()
            self._state = "broken"
            raise
        self._state = "ready"

    def _segment_freed(self, path: str) -> None:  # any thread, or the GC (a tensor died)
        rs = self._rs
        if rs is not None:
            rs.freed(path, int(os.path.basename(path).split("-")[2][1:]))

    def _sink(self, rank: int, stream: str, text: str) -> None:
        (self.output or default_sink)(rank, stream, text)

    def restart(self, **changes) -> "Group":
        """Stop the workers and start fresh ones, with any option changed (``world_size=``,
        ``backend=``, ``device=``, ``timeout=``...). Per-rank variables are lost."""
        if self._launcher.restart_refusal:
            raise GroupClosedError(self._launcher.restart_refusal)
        unknown = set(changes) - set(self._opts)
        if unknown:
            raise TypeError(f"restart() got unknown option(s) {sorted(unknown)}; "
                            f"valid: {sorted(self._opts)}")
        with self._lock:
            self._configure(**changes)  # validate before stopping anything
            self._shutdown()
            self._stop_requested = False
            self._launch()
        return self

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop every worker (process groups destroyed first) and release all resources.

        ``timeout``: how long to wait for a call running in another thread to finish. After it,
        that call's ranks are killed; the call then raises :class:`GroupClosedError` in its own
        thread, which releases everything, and this method waits up to 5 s for that.
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            self._stop_requested = True
            rs = self._rs
            if rs is not None:
                rs.kill(range(len(rs.ranks)))  # handles stay with the call's thread
            if not self._lock.acquire(timeout=5.0):
                return  # that thread is wedged outside nbdist; its ranks are dead already
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
        """Ask idle ranks to stop, kill the rest, reap everything, release every resource."""
        rs, self._rs = self._rs, None
        if rs is not None:
            rs.shutdown()
        self._cleanup()

    def _teardown(self) -> None:
        """After a failure: kill what still runs, release everything; ``restart()`` brings it back."""
        if self._rs is not None:
            self._rs.kill(r.rank for r in self._rs.ranks if r.state == "busy")
        self._shutdown()
        self._state = "stopped" if self._stop_requested else "broken"

    def _cleanup(self) -> None:
        if self._relay is not None:
            self._relay.drain(flush_partial=True)
            self._relay.close()
            self._relay = None
        shmpool.set_release_hook(self.id, None)
        segments.remove_segments(segments.leftover_segments(self.id))
        self._store = None
        self._launcher.cleanup()
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
        payload, segs = self._pickle((fn, tuple(args), dict(kwargs or {})), f"function {name}")
        return self._call("run", payload, ranks, timeout, f"run {name}", segs)

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
        payload, segs = self._pickle(merged, "pushed value")
        self._call("push", payload, ranks, None, f"push {', '.join(merged)}", segs)

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
            if self._opts["auto_restart"] and not self._launcher.restart_refusal:
                self._shutdown()
                self._launch()
                return
            raise GroupClosedError("this group is broken after an earlier failure (see the error "
                                   "above); call restart() to start fresh workers.")

    def _call(self, kind: str, payload: Any, ranks, timeout, what: str, segs=()) -> List[Any]:
        try:
            with self._lock:
                targets = self._targets(ranks)
                self._check_usable()
                timeout = timeout if timeout is not None else self._opts["call_timeout"]
                if timeout is not None and (isinstance(timeout, bool) or timeout <= 0):
                    raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
                call = Call(next(self._seq), kind, payload, targets, timeout, what)
                self._relay.context = contextvars.copy_context()
                self._state = "busy"
                try:
                    call.send(self._rs)
                    call.wait(self._rs)
                    verdict = settle(call, self._rs, self._opts["grace"],
                                     self._opts["auto_restart"], self.world_size)
                except BaseException:
                    self._teardown()  # something unforeseen mid-call: no channel can be trusted
                    raise
                if verdict.broken or self._stop_requested:
                    self._teardown()
                else:
                    self._state = "ready"
                if self._stop_requested:
                    raise GroupClosedError(
                        f"this group was stopped (stop() from another thread) while '{what}' ran "
                        "on its ranks; they were killed. Start a new group, or restart() "
                        "this one.") from verdict.error
                if verdict.error is not None:
                    raise verdict.error
                return verdict.results
        finally:
            segments.remove_segments(segs)

    # ---- status -------------------------------------------------------------------------------
    def status(self) -> GroupStatus:
        """Per-rank state (idle / busy with what since when / dead with exit code), pid, memory."""
        return collect_status(self._state, self.world_size, self.backend, self.device, self._ranks)


def start(world_size: int = 2, backend: Optional[str] = "auto", device: Optional[str] = "auto",
          timeout: float = 60.0, **options) -> Group:
    """Start a :class:`Group` of ``world_size`` ranks and return it once torch.distributed is ready.

    See :class:`Group` for the options. Use it as a context manager to stop it at the end.
    """
    return Group(world_size, backend, device, timeout, **options)


