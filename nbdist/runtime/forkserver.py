"""Where fresh workers come from: forkserver children with torch preloaded, spawn elsewhere.

Workers never import the caller's ``__main__`` (multiprocessing normally re-runs the main script in
every child): :func:`main_hidden` shows multiprocessing a ``__main__`` without a file while a worker
(or the forkserver) starts.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import sys
import threading
import types
from typing import Optional


def mp_context():
    """forkserver (torch preloaded) where available, spawn elsewhere (Windows)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["nbdist.runtime.preload"])  # the worker module, torch
        return ctx
    return mp.get_context("spawn")


def prewarm(background: bool = True) -> Optional[threading.Thread]:
    """Start the forkserver (and its torch import, about a second) now, so the first group starts
    fast. ``%load_ext nbdist`` calls this in the background (the thread is returned). No-op where
    there is no forkserver.

    The forkserver starts with SIGINT blocked, and ignores it from its first import on
    (:mod:`nbdist.runtime.preload`): an "interrupt kernel" or a kernel shutdown during its imports
    neither kills it nor prints a ``KeyboardInterrupt`` traceback.
    """
    ctx = mp_context()
    if ctx.get_start_method() != "forkserver":
        return None

    def run():
        from multiprocessing import forkserver, resource_tracker

        resource_tracker.ensure_running()  # first: it blocks and unblocks signals by itself
        with _sigint_blocked(), main_hidden():
            forkserver.ensure_running()

    if not background:
        run()
        return None
    thread = threading.Thread(target=run, name="nbdist-prewarm", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _sigint_blocked():
    """Hold SIGINT back in this thread (only), and so in the processes it starts meanwhile."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Hidden:
    """Who is hiding ``__main__`` now: the first to enter saves the real one, the last to leave puts
    it back, so overlapping swaps (the pre-warm thread and a group starting) can't leave the
    stand-in installed for good."""

    lock = threading.Lock()
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
