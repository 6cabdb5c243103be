"""Where fresh workers come from: forkserver children with torch preloaded, spawn elsewhere.

Workers never import the caller's ``__main__`` (multiprocessing normally re-runs the main script in
every child): :func:`main_hidden` shows multiprocessing a ``__main__`` without a file while a worker
(or the forkserver) starts.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import threading
import types
from typing import Optional


def mp_context():
    """forkserver (torch preloaded) where available, spawn elsewhere (Windows)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["nbdist.runtime.worker"])
        return ctx
    return mp.get_context("spawn")


def prewarm(background: bool = True) -> None:
    """Start the forkserver (and its torch import, about a second) now, so the first group starts
    fast. ``%load_ext nbdist`` calls this in the background. No-op where there is no forkserver."""
    ctx = mp_context()
    if ctx.get_start_method() != "forkserver":
        return

    def run():
        from multiprocessing import forkserver

        with main_hidden():
            forkserver.ensure_running()

    if background:
        threading.Thread(target=run, name="nbdist-prewarm", daemon=True).start()
    else:
        run()


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
