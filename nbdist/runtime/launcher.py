"""Launchers: where a group's ranks come from. :class:`LocalLauncher` starts fresh worker processes
on this machine; :class:`nbdist.runtime.attach.AttachLauncher` accepts ranks that torchrun or srun
started elsewhere. Both hand back ready :class:`~nbdist.runtime.ranks.Rank` s through the same
accept/ready loop (:mod:`nbdist.runtime.ready`), or raise leaving nothing running.

A local launch owns everything shared: the control listener (loopback, port 0), the rendezvous (a
``FileStore`` in the group's private temp dir: no port at all, so no "address already in use" and
nothing to reach from outside), and the group key. Workers are fresh processes: forkserver children
with torch preloaded where the OS has forkserver, spawned interpreters elsewhere
(:mod:`nbdist.runtime.forkserver`); they never import the caller's ``__main__``.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import cloudpickle

from ..backends import BackendChoice, resolve_backend
from ..backends.cores import usable_cores
from ..wire import pool, segments, transport
from ..wire.deadline import Deadline
from ..wire.relay import OutputRelay
from .advice import option
from .current import say_once
from . import forkserver, imports, spares
from .forkserver import check_start_method, main_hidden, mp_context
from .processes import LocalProcess
from .ranks import ASKED_S, STREAMS_S, Rank, RankSet
from .reaper import reap_ranks
from .ready import Admission, accept_until_ready
from .status import debug_env
from .streams import stream_mode
from .teardown import interrupts_deferred, run_all

#: Run on every rank right after torch.distributed is initialised ("module:function" strings, so
#: the runtime does not import the layers above it). Lightning's guards only install an import hook:
#: Lightning itself is patched if and when code on the rank imports it.
RANK_HOOKS = ("nbdist.lightning.guards:install_hooks",)


class Launcher:
    """Where the ranks of a group come from. A :class:`~nbdist.Group` calls, in order,
    :meth:`choose` (validate options, resolve the backend), :meth:`launch` (ranks ready, or raise
    leaving none running), :meth:`resolved` (what the ranks use: the group reports it), and
    :meth:`cleanup` when the group stops."""

    #: a failed call ends every other rank too: ranks a launcher elsewhere started (torchrun, srun)
    #: must exit for it to see the job fail, or restart it (:meth:`RankSet.abort_remote
    #: <nbdist.runtime.ranks.RankSet.abort_remote>`); ranks nbdist started are its own to stop
    ends_survivors = False
    #: why :meth:`nbdist.Group.restart` cannot work for this kind of group (``None``: it can)
    restart_refusal: Optional[str] = None
    #: what to do with a broken group of this kind
    broken_advice = "call restart() to start fresh workers."

    def choose(self, opts: Dict[str, Any]) -> BackendChoice:
        """Resolve the backend and device of ``opts`` for these ranks; raise on what cannot work."""
        raise NotImplementedError

    def launch(self, group_id: str, choice: BackendChoice, opts: Dict[str, Any],
               threads: Optional[int], tmp: str, relay: OutputRelay) -> Tuple[List[Rank], Any]:
        """Ranks ready to serve, and the rendezvous store to keep alive (``None`` if none)."""
        raise NotImplementedError

    def resolved(self, choice: BackendChoice, ranks: List[Rank]) -> BackendChoice:
        """The backend and device the ready ``ranks`` use (``choice`` itself by default)."""
        return choice

    def cleanup(self, deadline: Optional[Deadline] = None) -> None:
        """Remove what :meth:`launch` left on this machine (nothing by default), by ``deadline``
        (``None``: each step's own bound)."""

    def can_relaunch(self, auto_restart: bool) -> bool:
        """Whether a broken group starts again on its next call (``auto_restart`` by default)."""
        return auto_restart and not self.restart_refusal

    def close(self, deadline: Optional[Deadline] = None) -> None:
        """The group stopped for good (after :meth:`cleanup`): release what outlives one launch
        (by ``deadline``, as :meth:`cleanup`)."""


class Incarnation:
    """What one start of a group made, released together: its temp dir, output relay, rendezvous
    store and ranks (:class:`~nbdist.runtime.ranks.RankSet`). A failed start releases what it made
    before the error propagates; :meth:`shutdown` stops the ranks and releases the rest, to the
    end even when interrupted (:mod:`.teardown`); :attr:`done` says it got there."""

    def __init__(self, group_id: str, launcher: Launcher, choice: BackendChoice,
                 opts: Dict[str, Any], output):
        self.group_id, self.launcher, self.choice = group_id, launcher, choice
        self.tmp: Optional[str] = None
        self.relay: Optional[OutputRelay] = None
        self.store: Any = None
        self.rs: Optional[RankSet] = None
        self.done = False  #: everything released (:meth:`shutdown` ran to its end)
        #: what :meth:`shutdown` could not end by its deadline: ``{rank: why}``
        self.left: Dict[int, str] = {}
        try:
            threads = threads_per_rank(opts)
            segments.sweep_orphans()
            self.tmp = tempfile.mkdtemp(prefix=f"nbdist-{group_id}-p{os.getpid()}-")
            self.relay = OutputRelay(output.line, output.tick)
            ranks, self.store = launcher.launch(group_id, choice, opts, threads, self.tmp,
                                                self.relay)
            self.rs = RankSet(ranks, self.relay, launcher.ends_survivors)
            self.choice = launcher.resolved(choice, ranks)
            pool.set_release_hook(group_id, self._segment_freed)
        except BaseException:
            self.shutdown()
            raise

    def _segment_freed(self, path: str) -> None:  # any thread, or the GC (a tensor died)
        rs = self.rs
        if rs is not None:
            rs.freed(path, int(os.path.basename(path).split("-")[2][1:]))

    def shutdown(self, deadline: Optional[Deadline] = None) -> None:
        """Ask idle ranks to stop, kill the rest, reap everything, release every resource (once;
        again after an interrupted try), all by ``deadline`` (default :data:`SHUTDOWN_S` s);
        what it could not end by then is in :attr:`left`. Every step runs even if one fails or
        Ctrl-C comes: that error or interrupt is raised once all is released."""
        if self.done:
            return
        deadline = deadline or Deadline(SHUTDOWN_S)
        with interrupts_deferred():
            try:
                run_all(lambda: self._stop_ranks(deadline), self._show_last_output,
                        self._close_relay, lambda: pool.set_release_hook(self.group_id, None),
                        lambda: segments.remove_segments(
                            segments.leftover_segments(self.group_id)),
                        self._drop_store, lambda: self.launcher.cleanup(deadline),
                        self._remove_tmp)
            finally:
                self.done = True

    def _stop_ranks(self, deadline: Deadline) -> None:
        rs = self.rs
        if rs is None:
            return
        try:
            left = rs.shutdown(deadline)
        except BaseException:  # what a failed shutdown left running goes now
            reap_ranks(rs.ranks, Deadline.earliest(deadline, Deadline(ASKED_S)))
            raise
        why = ("its thread (a background job waiting for its ranks) still reads them; that "
               "thread reaps them when it ends" if rs.orphaned else
               "it did not end within the time left (its host does not answer?)")
        self.left = {r: why for r in left}

    def _show_last_output(self) -> None:
        if self.relay is not None:
            self.relay.drain(flush_partial=True)

    def _close_relay(self) -> None:
        if self.relay is not None:
            self.relay.close()

    def _drop_store(self) -> None:
        self.store = None  # a TCPStore server ends (and closes its socket) when freed

    def _remove_tmp(self) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def _checked_env(opts: Dict[str, Any]) -> Tuple[Dict[str, str], bool]:
    """The ranks' environment, and whether their large tensors travel as shared files; a bad
    NBDIST_STREAMS, NBDIST_TENSORS or NBDIST_PRELOAD in it is refused here, before any rank
    starts."""
    env = dict(os.environ)
    env.update(opts["env"] or {})
    env.update(debug_env(opts["debug"]))
    stream_mode(env)
    shared = segments.shared_files(env)
    imports.check(env)
    return env, shared


class LocalLauncher(Launcher):
    """Fresh worker processes on this machine, started with ``start_method`` (``"forkserver"`` or
    ``"spawn"``; ``None``: ``NBDIST_START_METHOD``, else forkserver where the OS has it). The
    method is checked here, before anything starts, and kept for every restart. ``protect``:
    every message signed."""

    def __init__(self, start_method: Optional[str] = None, protect: bool = False):
        self.start_method = check_start_method(start_method)
        self.protect = protect

    def choose(self, opts: Dict[str, Any]) -> BackendChoice:
        """Resolve the backend; refuse a world size this machine cannot run well, and the
        variables a start reads (checked again at launch) that it would refuse: a restart then
        refuses them before it stops the running ranks."""
        _checked_env(opts)
        choice = resolve_backend(opts["backend"], opts["device"])
        ws = opts["world_size"]
        limit = opts["max_world_size"] or (cpu_limit() if choice.device == "cpu" else None)
        if choice.device == "cuda":
            import torch

            limit = opts["max_world_size"] or torch.cuda.device_count()
        if limit is not None and ws > limit:
            raise ValueError(
                f"world_size={ws} is more than this machine runs well on device "
                f"{choice.device!r} (limit {limit}: "
                f"{'one rank per GPU' if choice.device == 'cuda' else '4 ranks per CPU core'}). "
                f"Use a smaller world size, or pass {option('max_world_size')} to raise the limit.")
        return choice

    def launch(self, group_id, choice, opts, threads, tmp, relay):
        """Start ``world_size`` workers; return them once all are ready (or raise, leaving none)."""
        env, shared = _checked_env(opts)
        ranks = start_workers(group_id, choice, opts["world_size"], float(opts["timeout"]),
                              threads, env, os.path.join(tmp, "store"), relay,
                              float(opts["init_timeout"] or opts["timeout"]), self.protect,
                              self.start_method, shared)
        return ranks, None


def prewarm(background: bool = True):
    """Get the next group's workers ready ahead of time, as ``%load_ext nbdist`` does: start the
    forkserver (torch imported, :func:`nbdist.runtime.forkserver.prewarm`) where workers are forked
    from it, or spawn warm spares (:mod:`nbdist.runtime.spares`) where they are spawned. Returns
    the background thread (``None`` with ``background=False``, or when there is nothing to warm:
    a bad ``NBDIST_START_METHOD``, which the group's start reports)."""
    try:
        method = check_start_method(None)
    except ValueError:
        return None
    if method == "forkserver":
        return forkserver.prewarm(background)
    return spares.warm(background)


def restart_refusal(group) -> Optional[str]:
    """Why ``group.restart()`` cannot work (an attached group), or ``None`` where it can."""
    return getattr(getattr(group, "_launcher", None), "restart_refusal", None)


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
                  relay: OutputRelay, init_timeout: float, protect: bool = False,
                  start_method: Optional[str] = None,
                  shared: bool = segments.SHARED_FILES) -> List[Rank]:
    """Start ``world_size`` workers and return them once all are ready (or raise, leaving none);
    ``shared``: their large results travel as shared files (else inside the message)."""
    key = transport.new_key()
    listener = transport.listen("127.0.0.1", 0)
    port = listener.getsockname()[1]
    ctx = mp_context(start_method)
    spawned = ctx.get_start_method() == "spawn"
    if spawned:
        spares.target()  # a bad NBDIST_SPARES is refused here, before any rank starts
    warm = spares.take(world_size) if spawned else []
    custom = custom_backend_blobs(choice)
    ranks: Dict[int, Rank] = {}
    try:
        for r in range(world_size):
            cfg = {"rank": r, "world_size": world_size, "local_rank": r, "group_id": group_id,
                   "address": ("127.0.0.1", port), "key": key, "backend": choice.backend,
                   "device": choice.device, "timeout": timeout, "threads": threads,
                   "custom_backends": custom, "store_path": store_path, "shm": shared,
                   "rank_hooks": RANK_HOOKS, "env": rank_env(env, r, world_size, port)}
            name = f"nbdist-{group_id}-rank{r}"
            proc = warm.pop(0).hand(cfg, name) if warm else None
            if proc is None:  # no spare (left): a fresh process imports torch itself
                proc = ctx.Process(target=worker_entry, args=(cfg,), name=name)
                with main_hidden():
                    proc.start()
            ranks[r] = Rank(r, LocalProcess(proc))
        admission = Admission()
        admission.protect = protect
        ready = accept_until_ready(listener, key, world_size, ranks, relay, init_timeout,
                                   admission)
    except BaseException:
        for spare in warm:  # not handed out (an error midway)
            spare.discard()
        reap_ranks(ranks.values(), Deadline(FAILED_START_S), relay=relay, streams_s=STREAMS_S)
        raise
    finally:
        listener.close()
    if spawned:  # for the next start or restart, in the background: never under the group's lock
        spares.warm()
    return ready


def worker_entry(cfg: Dict[str, Any]) -> None:
    """A local worker's process target. The worker module (and torch with it) is imported in
    the child, never here: the kernel needs torch only when a tensor arrives (the forkserver has
    both preloaded, so a forked worker finds them imported)."""
    from .worker import main

    main(cfg)


#: seconds a whole shutdown may take by default (a stop with a timeout takes what is left of it)
SHUTDOWN_S = 7.5
#: seconds the ranks of a start that failed get to be reaped once killed
FAILED_START_S = 5.0


def threads_per_rank(opts: Dict[str, Any]) -> Optional[int]:
    """torch threads per rank: the cores this process may use (its CPU affinity: taskset, a
    cgroup cpuset, srun --cpu-bind) shared among the ranks unless told (said once)."""
    cores = usable_cores()
    if opts["threads"] is None and "OMP_NUM_THREADS" not in os.environ and \
            "OMP_NUM_THREADS" not in (opts["env"] or {}) and opts["world_size"] > 1:
        threads = max(1, cores // opts["world_size"])
        say_once(f"nbdist: torch uses {threads} thread{'s' if threads > 1 else ''} per rank "
                 f"({cores} core{'s' if cores > 1 else ''} shared by {opts['world_size']} ranks); "
                 f"pass {option('threads')} to change.")
        return threads
    return opts["threads"]


def custom_backend_blobs(choice: BackendChoice) -> List[bytes]:
    """The custom backends of a backend choice, pickled for the workers."""
    return [cloudpickle.dumps(c) for c in choice.custom]


def cpu_limit() -> int:
    """The largest world size nbdist starts on the CPUs it may use without being told to."""
    return max(8, 4 * usable_cores())
