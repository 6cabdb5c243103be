"""``Group``: a persistent set of ranks with torch.distributed initialised, and the calls on it.

Calls are synchronous: the same request goes to every chosen rank and the caller waits for all
replies while watching each worker's process sentinel (see :mod:`nbdist.runtime.calls`). So a rank
that dies is reported at once (:class:`RankDiedError`), a deadline gives :class:`DistTimeoutError`,
and Ctrl-C / the notebook's interrupt button interrupts the ranks (SIGINT), kills those still
blocked after a short grace period, and raises :class:`GroupInterrupted`. A Python error on a rank
raises :class:`RemoteError` with the remote traceback and leaves the group usable.

The group alone writes its state (ready, busy, broken, stopped); threads: :mod:`nbdist.runtime`.
"""
from __future__ import annotations

import itertools
import secrets
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

from ..errors import GroupBusyError, GroupClosedError
from ..wire import locks, segments
from ..wire.deadline import Deadline
from ..wire.relay import Sink
from . import imports, requests, stopping
from .calls import Call
from .current import _live, current_group, say_once, set_current, started_ids  # noqa: F401
from .dispatch import Dispatch
from .jobs import Job
from .launcher import SHUTDOWN_S, Incarnation, Launcher, LocalLauncher
from .metrics import Metrics
from .output import RankOutput, rank_nodes
from .ranks import Rank, RankSet
from .status import (DETAIL_NOTE, GroupStatus, check_options, collect_status, debug_env,
                     generation_note)
from .teardown import interrupts_deferred


#: Seconds ``stop(timeout)`` keeps, of its time, to wait for the thread holding the group once it
#: killed what that thread runs (so ``stop`` takes at least this long to give up on it).
STOP_WAIT = 5.0
#: Seconds of a ``stop(timeout)`` that the thread it waits for keeps free when it tears the group
#: down itself (the moment a killed process needs to be reaped, then its last lines)
HOLDER_RESERVE_S = 1.0


class Group(Dispatch):
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
        debug: ``"detail"`` sets torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` on the ranks before
            ``init_process_group``: every collective is checked against the other ranks', and a
            mismatch raises a :class:`RemoteError` naming each rank's call (op, shapes, dtype);
            a store round trip per collective (a small step ran 2.4x slower). On torch 2.13
            with gloo, a DDP model's backward crashes every rank (SIGSEGV) in this mode.
            ``"off"`` (the default); ``True`` and ``False`` mean the same.
        grace: seconds a rank gets to react to SIGINT before it is killed.
        auto_restart: restart the group by itself after a failure that broke it.
        output: ``sink(rank, stream, text)`` receiving every line of the ranks' output, in order,
            on a thread of its own (``nbdist-sink``); a call returns once the sink got its lines.
        dedupe_output: show a repeated line once, labelled with its ranks (:attr:`dedupe_output`).
        max_world_size: raise the limit on ``world_size`` (4 ranks per CPU core; one rank per
            GPU: ranks beyond the GPUs then share them, rank ``i`` on GPU ``i % count``).
        stall: seconds without progress (nothing logged or printed, no collective completed)
            after which a background job shows as "stalled", with the ranks' stacks and their
            collectives compared (:attr:`Job.stalled <nbdist.Job.stalled>`); ``None``: never.
            A stall kills nothing.
    """

    def __init__(self, world_size: int = 2, backend: Optional[str] = "auto",
                 device: Optional[str] = "auto", timeout: float = 60.0, *,
                 call_timeout: Optional[float] = None, init_timeout: Optional[float] = None,
                 threads: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                 debug: Union[str, bool, None] = "off", grace: float = 0.5,
                 auto_restart: bool = False, output: Optional[Sink] = None,
                 max_world_size: Optional[int] = None,
                 dedupe_output: bool = True, stall: Optional[float] = 60.0,
                 _launcher: Optional[Launcher] = None):
        self.id = secrets.token_hex(4)
        self._launcher = _launcher or LocalLauncher()
        self._lock = locks.make("group", reentrant=True)  # a call, send to settle; lifecycle
        self._seq = itertools.count(1)
        self._ranks: List[Rank] = []  # the current (or last) ranks, for status()
        self._rs: Optional[RankSet] = None  # the running ranks as a call sees them
        self._state = "new"
        self._stop_requested = False  # by stop() from another thread; see stop()
        self._launching = False  # the holder of the lock is starting ranks
        self._stopping = False  # the holder of the lock is in stop()
        self._doing = ""  # what the holder was doing when stop() from another thread came
        self._stop_by: Optional[Deadline] = None  # a stop's deadline for the holder's teardown
        self._left: Dict[int, str] = {}  # what the last shutdown could not end, and why
        self._job: Optional[Job] = None  # the last background job (running or not)
        self._last_call: Optional[Call] = None
        self._inc: Optional[Incarnation] = None  # what one start made: ranks, relay, temp dir
        self.output = output
        self._out = RankOutput(dedupe_output, lambda: self.output, lambda: rank_nodes(self._ranks))
        self._opts: Dict[str, Any] = {}
        self._configure(world_size=world_size, backend=backend, device=device, timeout=timeout,
                        call_timeout=call_timeout, init_timeout=init_timeout, threads=threads,
                        env=env, debug=debug, grace=grace, auto_restart=auto_restart,
                        max_world_size=max_world_size, stall=stall)
        _live.add(self)
        started_ids.add(self.id)
        self._launch()
        if current_group() is None or current_group().state == "stopped":
            use_group(self)

    # ---- configuration ------------------------------------------------------------------------
    def _configure(self, **opts) -> None:  # validate everything before anything changes
        new = dict(self._opts, **opts)
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
    def _launch(self) -> None:
        stopped = ("this group was stopped (stop() from another thread) while it was starting "
                   "ranks; nothing was left running. Start a new group, or restart() this one.")
        closed = GroupClosedError(stopped)
        try:
            if self._stop_requested:
                raise closed
            say_once(self._choice.note)
            if debug_env(self._opts["debug"]):
                say_once(DETAIL_NOTE)
            self._launching = True  # stop() from another thread may close the launcher now
            try:
                self._inc = Incarnation(self.id, self._launcher, self._choice, self._opts,
                                        self._out)
            finally:
                self._launching = False
        except BaseException as err:
            if not self._stop_requested:
                self._state = "broken"
                raise
            self._state, self._stop_requested = "stopped", False  # the stop is done
            if err is closed:  # (the launcher's own refusal, closed meanwhile, says less)
                raise
            raise closed from err
        self._ranks, self._rs, self._choice = self._inc.rs.ranks, self._inc.rs, self._inc.choice
        self._state, self._preloaded = "ready", set()
        if self._stop_requested:  # it came while these ranks started: they go at once
            self._shutdown()
            self._state, self._stop_requested = "stopped", False
            raise GroupClosedError(stopped)

    @property
    def dedupe_output(self) -> bool:
        """Quiet ranks (default ``True``): a line that several ranks print, or a rank again and
        again, is shown once, labelled with its ranks; a summary at the end of the call says how
        often. ``False`` (settable) shows every line; a custom ``output`` sink gets every line."""
        return self._out.dedupe

    @dedupe_output.setter
    def dedupe_output(self, value: bool) -> None:
        self._out.dedupe = value

    @property
    def last_output(self) -> Dict[int, List[str]]:
        """Per rank, every line printed in the last call or job (repeats too; the last 1000)."""
        return self._last_call.output if self._last_call is not None else {}

    def restart(self, **changes) -> "Group":
        """Stop the workers and start fresh ones, with any option changed (``world_size=``,
        ``backend=``, ``device=``, ``timeout=``...). Per-rank variables are lost; a running
        background job is interrupted first, as by :meth:`stop`."""
        if self._launcher.restart_refusal:
            raise GroupClosedError(self._launcher.restart_refusal)
        unknown = set(changes) - set(self._opts)
        if unknown:
            raise TypeError(f"restart() got unknown option(s) {sorted(unknown)}; "
                            f"valid: {sorted(self._opts)}")
        if self._job is not None:  # as stop(): a running background job is interrupted first
            self._job.end(self._opts["grace"] + 10.0)
        with self._lock:
            self._configure(**changes)  # validate before stopping anything
            self._shutdown()
            self._job = None  # if it still runs, its ranks are gone: it ends by itself
            self._launch()
        return self

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop every worker (process groups destroyed first) and release all resources.

        ``timeout``: how long the whole stop may take, at least :data:`STOP_WAIT` s (``None``:
        as long as another thread holds the group, then up to :data:`SHUTDOWN_S
        <nbdist.runtime.launcher.SHUTDOWN_S>` s). A background job is interrupted first.
        Another thread that holds the group is waited for until :data:`STOP_WAIT` s are left;
        then that call's ranks are killed (its pdb prompt ends; it raises
        :class:`GroupClosedError` in its own thread, which releases everything) or a start is
        told to give up. If it still holds the group at the end, :class:`GroupBusyError` says
        what could not be stopped: the stop stays recorded, and that thread stops the group as
        soon as it is done. Ranks not confirmed gone in time (a host that does not answer, a
        job's thread still reading them) raise :class:`DistTimeoutError` naming them and why,
        once the group is stopped. Either way, nothing is left running silently.
        """
        budget = None if timeout is None else max(float(timeout), STOP_WAIT)
        deadline = Deadline(budget)
        self._left = {}
        if budget is not None:  # a job's or a call's own teardown fits in it, leaving a moment
            self._stop_by = Deadline(budget - HOLDER_RESERVE_S)
        if self._job is not None:  # a background job still running: interrupted first
            self._job.end(self._opts["grace"] + 10.0 if budget is None else
                          deadline.left() / 2)
        if not stopping.acquire(self, budget, deadline, STOP_WAIT):
            raise GroupBusyError(
                f"stop(timeout={timeout:g}) could not stop the group: another thread still "
                f"holds it {budget:g} s later ({self._doing}). The stop is recorded: that "
                "thread stops the group as soon as it is done; call stop() again to wait for it.")
        try:  # to its end, a Ctrl-C meanwhile raised after it (the group is stopped by then)
            with interrupts_deferred():
                self._stopping = True
                try:
                    if self._state != "stopped":
                        self._shutdown(deadline if budget is not None else None)
                finally:
                    self._state, self._stop_requested = "stopped", False
                    # an attached group stops listening for restarts
                    self._launcher.close(deadline if budget is not None else None)
                    self._stopping, self._stop_by = False, None
                    left = self._left  # this stop's, or the holder's teardown's
        finally:
            self._lock.release()
        if left:
            raise stopping.left_behind(left, SHUTDOWN_S if budget is None else budget)

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"<nbdist.Group {self.id}: {self._state}{generation_note(self._ranks)}, world_size="
                f"{self.world_size}, backend={self.backend!r}, device={self.device!r}>")

    def _shutdown(self, deadline: Optional[Deadline] = None) -> Dict[int, str]:
        """Ask idle ranks to stop, kill the rest, reap everything, release every resource, by
        ``deadline``; what could not be ended by then, ``{rank: why}``."""
        inc, job = self._inc, self._job
        if job is not None and job.call.outcome is None:  # its thread stops reading the ranks
            job.call.cancel()
        if inc is not None:  # runs to its end even if interrupted; else the next completes it
            inc.shutdown(deadline)
            self._left = inc.left
        self._inc = self._rs = None
        return inc.left if inc is not None else {}

    def _teardown(self) -> None:
        """After a failure: kill what still runs, release everything; ``restart()`` brings it back."""
        with interrupts_deferred():  # a Ctrl-C meanwhile is raised once the state is set
            try:
                if self._rs is not None:
                    self._rs.kill(r.rank for r in self._rs.ranks if r.state == "busy")
                self._shutdown(self._stop_by)  # within a stop's time, if one waits
            finally:
                self._state = "stopped" if self._stop_requested else "broken"
                self._stop_requested = False  # a stop from another thread is done

    # ---- calls --------------------------------------------------------------------------------
    def run(self, fn: Callable, *args, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order. ``fn``
        may be a lambda, a closure or a function defined in the notebook: it travels by value
        (cloudpickle). Use :meth:`call` to pick ranks or set a deadline."""
        return self.call(fn, args, kwargs)

    def call(self, fn: Callable, args: Sequence = (), kwargs: Optional[Dict[str, Any]] = None,
             ranks: Optional[Iterable[int]] = None, timeout: Optional[float] = None) -> List[Any]:
        """Like :meth:`run`, on the chosen ``ranks`` (default all) and with a ``timeout`` (s)."""
        return self._call(requests.run_request(fn, args, kwargs, self._prefix), ranks, timeout)

    def exec(self, source: str, ranks: Optional[Iterable[int]] = None,
             timeout: Optional[float] = None) -> List[Any]:
        """Run Python ``source`` on the ranks, in a namespace that persists across calls; return
        each rank's value of the last expression (``None`` if the code ends with a statement).
        The namespace starts with ``torch``, ``dist``, ``rank``, ``world_size``, ``device``."""
        req = requests.exec_request(source, f"<dist-cell-{next(self._seq)}>")
        return self._call(req, ranks, timeout)

    def push(self, values: Optional[Dict[str, Any]] = None, /, *, ranks: Optional[Iterable[int]] = None,
             **kwargs) -> None:
        """Set variables in the ranks' namespaces: ``push(lr=0.1)`` or ``push({"x": t}, ranks=[0])``.

        CPU tensors travel through shared memory; every rank gets its own copy.
        """
        self._call(requests.push_request(dict(values or {}, **kwargs), self._prefix()), ranks, None)

    def pull(self, *names: str, ranks: Optional[Iterable[int]] = None) -> List[Any]:
        """Get variables from the ranks: one name -> ``[value_rank0, ...]``; several -> tuples."""
        values = self._call(requests.pull_request(names), ranks, None)
        return [v[0] if len(names) == 1 else v for v in values]

    def submit(self, fn: Callable, *args, ranks: Optional[Iterable[int]] = None,
               timeout: Optional[float] = None, **kwargs) -> Job:
        """Start ``fn(*args, **kwargs)`` on the ranks in the background; return a :class:`Job`
        at once. Other calls on the group raise :class:`GroupBusyError` until the job ends.
        ``ranks`` and ``timeout`` are this method's own (as in :meth:`call`)."""
        return self._submit(requests.run_request(fn, args, kwargs, self._prefix), ranks, timeout,
                            getattr(fn, "__name__", "job"))

    def submit_exec(self, source: str, ranks: Optional[Iterable[int]] = None,
                    timeout: Optional[float] = None, name: Optional[str] = None) -> Job:
        """:meth:`exec` in the background (what ``%%dist --bg`` does); returns a :class:`Job`."""
        req = requests.exec_request(source, f"<dist-cell-{next(self._seq)}>")
        return self._submit(req, ranks, timeout, name or "cell")

    def preload(self, *modules: str) -> bool:
        """Import ``modules`` on every rank right after this short call, and return at once; the
        next call starts there once they are imported. Does nothing and returns ``False`` while
        the group is busy or not ready; ``g.metrics`` stays the last real call's. A module
        missing on a rank raises :class:`RemoteError`."""
        if self._state != "ready" or self.job is not None:
            return False
        todo = [m for m in modules if m not in self._preloaded]
        last = self._last_call
        try:
            if todo:
                self._call(requests.run_request(imports.start, (todo,), {}, self._prefix), None, 30)
        finally:
            self._last_call = last
        self._preloaded.update(todo)
        return True

    @property
    def job(self) -> Optional[Job]:
        """The background job running on the group (``None`` when none runs)."""
        job = self._job
        return job if job is not None and job.running() else None

    @property
    def metrics(self):
        """What the ranks logged (``nbdist.log``) during the last call."""
        return self._last_call.metrics if self._last_call is not None else Metrics()

    def _prefix(self) -> Optional[str]:
        """The prefix of the shared-memory segments this kernel writes for the group's ranks
        (``None``: tensors travel inside the messages)."""
        return segments.shm_prefix(self.id, "c") if segments.shared_files() else None

    # ---- status -------------------------------------------------------------------------------
    def status(self) -> GroupStatus:
        """Per-rank state (idle / busy with what, since when / dead, exit code), pid, memory, job."""
        job = self.job
        return collect_status(self._state, self.world_size, self.backend, self.device, self._ranks,
                              job.describe() if job is not None else "")


def use_group(group: Optional[Group]) -> None:
    """Make ``group`` the current group (``None`` detaches)."""
    if group is not None and not isinstance(group, Group):
        raise TypeError(f"use_group() takes an nbdist.Group (or None), got {type(group).__name__}")
    set_current(group)
