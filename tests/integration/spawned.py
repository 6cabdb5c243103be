"""Ranks started for a test, for the process-group backend tests (test_store_backend.py,
test_shm_backend*.py): a TCPStore in the pytest process, and each rank reporting its result or its
traceback through it. Each rank is a fresh process, never a fork of pytest: a child of nbdist's
forkserver (torch imported there once) where there is one, else spawned. Spawning every rank, as
these tests did before, cost its torch import each time: the four modules took 129.5 CPU s, and
48.8 this way (issue 39)."""

import faulthandler
import json
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


def _entry(fn, rank, world_size, port, prefix, timeout):
    """Child process: connect to the parent's store, run fn, report "ok" or the traceback.

    A rank still running shortly before the parent gives up prints its stacks and exits.
    """
    faulthandler.dump_traceback_later(max(1, timeout - 5), exit=True)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    results = dist.PrefixStore(f"{prefix}/results", store)
    try:
        out = fn(rank, world_size, dist.PrefixStore(prefix, store))
        results.set(str(rank), json.dumps({"ok": out}))
    except BaseException:
        results.set(str(rank), json.dumps({"error": traceback.format_exc()}))
        raise


def _context():
    """nbdist's forkserver where there is one (torch preloaded: a rank skips its ~1.5 CPU s
    import), spawn elsewhere; either way each rank is a fresh process, not a fork of pytest."""
    from nbdist.runtime.forkserver import mp_context, start_methods

    return mp_context() if "forkserver" in start_methods() else mp.get_context("spawn")


def run_ranks(fn, world_size, timeout=90, may_die=()):
    """Run fn(rank, world_size, store) in fresh processes; return {rank: fn's result}.

    Fails on any error, except that ranks in ``may_die`` may exit without a result.
    """
    master = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    prefix = f"{getattr(fn, 'func', fn).__name__}-{time.monotonic_ns()}"  # fn: maybe a partial
    ctx = _context()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, master.port, prefix, timeout),
                         daemon=True) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        results = dist.PrefixStore(f"{prefix}/results", master)
        report = {r: json.loads(results.get(str(r))) if results.check([str(r)]) else
                  {"error": f"no result (exit code {p.exitcode})"} for r, p in enumerate(procs)}
        assert not hung, f"ranks {hung} still running after {timeout}s: {report}"
        failed = {r: v["error"] for r, v in report.items() if "error" in v and r not in may_die}
        assert not failed, "\n".join(f"--- rank {r}:\n{m}" for r, m in failed.items())
        return {r: v.get("ok") for r, v in report.items()}
    finally:  # never leave a child behind
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
