"""Where fresh workers come from: forkserver children with torch preloaded, spawn elsewhere.

The start method is ``"forkserver"`` where the OS has it (Linux, macOS) and ``"spawn"`` elsewhere
(Windows); ``nbdist.start(..., start_method="spawn")`` or the ``NBDIST_START_METHOD`` environment
variable choose spawn where both exist (each rank then imports torch itself: slower to start, but
nothing is inherited from a preloaded server). ``"fork"`` is refused: forking a kernel that runs
threads (the output relay, IPython's) can deadlock the child, and CUDA cannot be used after a fork.

Workers never import the caller's ``__main__`` (multiprocessing normally re-runs the main script in
every child): :func:`main_hidden` shows multiprocessing a ``__main__`` without a file while a worker
(or the forkserver) starts.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import types
from typing import Optional

from ..wire import locks


#: the environment variable that sets the default start method (``forkserver`` or ``spawn``)
ENV_VAR = "NBDIST_START_METHOD"


def start_methods() -> list:
    """The start methods nbdist can use here, the default first."""
    return [m for m in ("forkserver", "spawn") if m in mp.get_all_start_methods()]


def check_start_method(method: Optional[str]) -> str:
    """``method`` if nbdist can start workers that way here (``None``: the default), else raise."""
    usable = start_methods()
    if method is None:
        method = os.environ.get(ENV_VAR) or usable[0]
        where = f" (from {ENV_VAR})" if os.environ.get(ENV_VAR) else ""
    else:
        where = ""
    if method not in usable:
        raise ValueError(f"start_method must be one of {', '.join(map(repr, usable))} on this "
                         f"platform, got {method!r}{where}")
    return method


def mp_context(start_method: Optional[str] = None):
    """forkserver (torch preloaded) where available, spawn elsewhere (Windows) or when asked."""
    method = check_start_method(start_method)
    ctx = mp.get_context(method)
    if method == "forkserver":
        _check_listener_path()
        ctx.set_forkserver_preload(["nbdist.runtime.preload"])  # the worker module, torch
    return ctx


#: bytes a Unix socket's path may take, its final NUL included (``sockaddr_un.sun_path``)
SUN_PATH = 104 if sys.platform == "darwin" else 108


def _check_listener_path() -> None:
    """The forkserver listens on a Unix socket in multiprocessing's temp dir (under TMPDIR): refuse
    a TMPDIR so long that the socket's path cannot fit, saying so (the bind fails deep inside
    multiprocessing with a bare "AF_UNIX path too long")."""
    import tempfile
    from multiprocessing import util

    path = os.path.join(util.get_temp_dir(), "listener-abcdefgh")  # as multiprocessing names it
    size = len(os.fsencode(path)) + 1
    if size > SUN_PATH:
        raise ValueError(
            f"the forkserver that starts nbdist's workers cannot listen under this TMPDIR: its "
            f"socket path would take {size} bytes ({path}), and a Unix socket's path may take "
            f"{SUN_PATH}. Set TMPDIR to a shorter directory (such as /tmp) before Python starts "
            f"(tempfile.gettempdir() is {tempfile.gettempdir()!r}), or start workers by spawn, "
            f"which needs no socket: start(..., start_method='spawn'), or {ENV_VAR}=spawn in "
            "the environment (the magics too).")


def prewarm(background: bool = True) -> Optional[threading.Thread]:
    """Start the forkserver (and its torch import, about a second) now, so the first group starts
    fast. ``%load_ext nbdist`` calls this in the background (the thread is returned). No-op where
    there is no forkserver, or when the default start method is spawn.

    The forkserver starts with SIGINT blocked, and ignores it from its first import on
    (:mod:`nbdist.runtime.preload`): an "interrupt kernel" or a kernel shutdown during its imports
    neither kills it nor prints a ``KeyboardInterrupt`` traceback.
    """
    try:
        ctx = mp_context()
    except ValueError:  # a bad NBDIST_START_METHOD: the group's start says so
        return None
    if ctx.get_start_method() != "forkserver":
        return None

    def run():
        from multiprocessing import forkserver, resource_tracker

        resource_tracker.ensure_running()  # first: it blocks and unblocks signals by itself
        with sigint_held(), main_hidden():
            forkserver.ensure_running()

    if not background:
        run()
        return None
    thread = threading.Thread(target=run, name="nbdist-prewarm", daemon=True)
    thread.start()
    return thread


def close_helpers(wait: float = 2.0) -> None:
    """End this process's forkserver and resource tracker (multiprocessing's helpers, which
    nbdist's start method starts) and reap them. For a kernel about to shut down: ipykernel ends
    every child left in its process group before it exits, and a helper it has to signal (the
    tracker ignores SIGTERM) or one it cannot reap holds the shutdown for ~30 s, long enough for
    Jupyter to kill the kernel before its own exit handlers (which stop the groups) run. Call it
    after the groups are stopped; a later group starts the helpers again."""
    if os.name != "posix":
        return
    from multiprocessing import forkserver, resource_tracker

    try:
        _close(forkserver._forkserver, resource_tracker._resource_tracker, wait)
    except AttributeError:  # another Python's internals: leave them to ipykernel
        pass


def _close(server, tracker, wait: float) -> None:
    with server._lock:
        pid, server._forkserver_pid = server._forkserver_pid, None
        if pid is not None:  # it holds nothing: SIGTERM spares its slow exit (torch is loaded)
            with contextlib.suppress(OSError):
                os.close(server._forkserver_alive_fd)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            address = server._forkserver_address  # a socket file, unless in the abstract namespace
            if isinstance(address, str) and not address.startswith("\0"):
                with contextlib.suppress(OSError):
                    os.unlink(address)
            server._forkserver_alive_fd = server._forkserver_address = None
            _reap(pid, wait)
    with tracker._lock:
        pid, fd, tracker._pid, tracker._fd = tracker._pid, tracker._fd, None, None
        if fd is not None:  # it exits once every copy of its pipe is closed
            with contextlib.suppress(OSError):
                os.close(fd)
        if pid is not None:
            _reap(pid, wait)


def _reap(pid: int, wait: float) -> None:
    """Wait up to ``wait`` s for child ``pid`` to exit, then kill it; reap it either way."""
    deadline = time.monotonic() + wait
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not ours, or reaped already
            return
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.01)


@contextlib.contextmanager
def sigint_held():
    """Hold SIGINT back in this thread (only), and so in the processes it starts meanwhile (where
    signals can be blocked: not on Windows, where this does nothing)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Hidden:
    """Who is hiding ``__main__`` now: the first to enter saves the real one, the last to leave puts
    it back, so overlapping swaps (the pre-warm thread and a group starting) can't leave the
    stand-in installed for good."""

    lock = locks.make("main", module_level=True)
    count = 0
    real: Optional[types.ModuleType] = None


@contextlib.contextmanager
def main_hidden():
    """Make multiprocessing see a ``__main__`` without a file, so children don't re-import it.

    Safe from several threads at once and nested: everyone inside sees the stand-in until the last
    one leaves.
    """
    with _Hidden.lock:
        if _Hidden.count == 0:
            _Hidden.real = sys.modules.get("__main__")
            sys.modules["__main__"] = types.ModuleType("__main__")
        _Hidden.count += 1
    try:
        yield
    finally:
        with _Hidden.lock:
            _Hidden.count -= 1
            if _Hidden.count == 0:
                if _Hidden.real is None:
                    sys.modules.pop("__main__", None)
                else:
                    sys.modules["__main__"] = _Hidden.real
                _Hidden.real = None
