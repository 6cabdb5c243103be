#!/usr/bin/env python
"""A 100 MiB tensor returned by nbdist, against torch multiprocessing and pickling queues, memcpy.

    python benchmarks/bench_tensor.py [--quick] [--out results.json] [--sizes 2,4]
    (also section ``tensor`` of bench_core.py)

A 100 MiB float32 CPU tensor that already lives on rank 0 (groups of world size 2 and 4, gloo on
CPU), returned to the caller: nbdist ``g.exec("big", ranks=[0])`` and ``g.pull("big", ranks=[0])``,
against a ``torch.multiprocessing`` queue (tensor private to the producer, and already in shared
memory) and against pickling through ``multiprocessing.Queue`` (a numpy array: bytes through the
pipe); next to single-core memcpy of 256 MiB measured in the same rounds (torch ``copy_`` into a
reused and into a fresh buffer, ``numpy.copyto``, libc ``memmove``): the ratios to memcpy use the
fastest of them, the limit of this machine in this run. Each method is timed until
the object is returned and until every page of it has been read once; the methods are interleaved
round by round (the first one rotates) so that machine noise hits all of them alike.

Raw samples (seconds) and summaries go to the JSON file; a compact table is printed at the end.
Everything the script starts is stopped at the end (a final sweep kills and reports leftovers).
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import time

import harness
from harness import fmt, fmt_summary, percentile, ratio, summary

NAME = "tensor"
FULL = dict(tensor_rounds=20)
QUICK = dict(tensor_rounds=5)
MIB = 1 << 20
BIG_BYTES = 100 * MIB
BIG_NUMEL = BIG_BYTES // 4  # float32
MEMCPY_BYTES = 256 * MIB


def _tensor_source(conn, tq, pq, numel):
    """Producer process for the queue comparisons (spawned, torch imported)."""
    import torch

    torch.set_num_threads(1)
    shared = torch.ones(numel)
    shared.share_memory_()
    obj = None
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        if cmd == "prep-private":
            obj = ("t", torch.ones(numel))  # a fresh private tensor, every page touched
        elif cmd == "prep-shared":
            obj = ("t", shared)
        elif cmd == "prep-pickle":
            obj = ("p", torch.ones(numel).numpy())
        if cmd.startswith("prep-"):
            conn.send("ready")
            continue
        kind, value = obj
        (tq if kind == "t" else pq).put(value)
        obj = None


def touch_pages(x):
    """Read one element per 4 KiB page (what any use of the result costs at least)."""
    import torch

    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(x)
    v = x.view(-1)
    assert v.numel() == BIG_NUMEL
    return float(v[::1024].sum())


def run(cfg, sizes, res, log):
    import multiprocessing

    import numpy as np
    import torch
    import torch.multiprocessing as tmp

    import nbdist

    sec = res["tensor"] = {"bytes": BIG_BYTES, "memcpy_bytes": MEMCPY_BYTES, "sizes": sizes}
    raw = {f"nbdist_exec_n{n}": [] for n in sizes}
    raw.update({f"nbdist_pull_n{n}": [] for n in sizes})
    for k in ("torch_queue_private", "torch_queue_shared", "mp_queue_pickle"):
        raw[k] = []
    touched = {k: [] for k in raw}
    mem = {"torch_copy": [], "torch_copy_fresh_dst": [], "numpy_copyto": [], "memmove": []}

    groups = {}
    ctx = tmp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    tq = ctx.Queue()
    pq = multiprocessing.get_context("spawn").Queue()
    src_proc = ctx.Process(target=_tensor_source, args=(child_conn, tq, pq, BIG_NUMEL), daemon=True)
    src_proc.start()
    threads = torch.get_num_threads()
    try:
        for n in sizes:
            g = groups[n] = nbdist.start(world_size=n)
            g.exec(f"big = torch.ones({BIG_NUMEL})", ranks=[0])

        def via_queue(kind):
            def fn():
                parent_conn.send(f"prep-{kind}")
                assert parent_conn.recv() == "ready"
                t0 = time.perf_counter()
                parent_conn.send("go")
                x = (pq if kind == "pickle" else tq).get(timeout=120)
                return t0, x
            return fn

        def via_nbdist(g, how):
            def fn():
                t0 = time.perf_counter()
                x = (g.exec("big", ranks=[0]) if how == "exec" else g.pull("big", ranks=[0]))[0]
                return t0, x
            return fn

        methods = []
        for n in sizes:
            methods.append((f"nbdist_exec_n{n}", via_nbdist(groups[n], "exec")))
            methods.append((f"nbdist_pull_n{n}", via_nbdist(groups[n], "pull")))
        methods += [("torch_queue_private", via_queue("private")),
                    ("torch_queue_shared", via_queue("shared")),
                    ("mp_queue_pickle", via_queue("pickle"))]

        src = torch.ones(MEMCPY_BYTES // 4)
        dst = torch.empty_like(src)
        nsrc, ndst = src.numpy(), dst.numpy()

        def memcpy_round():
            torch.set_num_threads(1)
            try:
                t0 = time.perf_counter()
                dst.copy_(src)
                mem["torch_copy"].append(time.perf_counter() - t0)
                fresh = torch.empty_like(src)
                t0 = time.perf_counter()
                fresh.copy_(src)
                mem["torch_copy_fresh_dst"].append(time.perf_counter() - t0)
                del fresh
                t0 = time.perf_counter()
                np.copyto(ndst, nsrc)
                mem["numpy_copyto"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), MEMCPY_BYTES)
                mem["memmove"].append(time.perf_counter() - t0)
            finally:
                torch.set_num_threads(threads)

        # warm-up (first touches, queue feeder threads, resource sharer)
        for name, fn in methods:
            _, x = fn()
            touch_pages(x)
            del x
        memcpy_round()
        for k in mem:
            mem[k].clear()
        for rnd in range(cfg["tensor_rounds"]):
            k = rnd % len(methods)
            for name, fn in methods[k:] + methods[:k]:
                gc.collect()
                t0, x = fn()
                t1 = time.perf_counter()
                touch_pages(x)
                t2 = time.perf_counter()
                raw[name].append(t1 - t0)
                touched[name].append(t2 - t0)
                del x
            gc.collect()
            memcpy_round()
        log("  tensor: " + ", ".join(f"{k} {fmt(percentile(v, 50), ms=True)}"
                                     for k, v in raw.items()))
    finally:
        for g in groups.values():
            g.stop()
        with contextlib.suppress(Exception):
            parent_conn.send("stop")
        src_proc.join(10)
        if src_proc.is_alive():
            src_proc.kill()
            src_proc.join(5)
    sec["raw_returned"] = raw
    sec["raw_touched"] = touched
    sec["raw_memcpy_256MiB"] = mem
    sec["summary"] = {k: {"returned": summary(raw[k]), "touched": summary(touched[k])} for k in raw}
    sec["memcpy_256MiB"] = {k: summary(v) for k, v in mem.items()}
    sec["memcpy_GBps"] = {k: MEMCPY_BYTES / percentile(v, 50) / 1e9 for k, v in mem.items() if v}


def ratios(res):
    tn = res.get("tensor", {})
    if not tn.get("summary"):
        return {}
    s = tn["summary"]
    # The limit is the fastest way this machine copied the bytes in the same run (the copies into
    # an existing buffer differ by up to 2x between libraries), scaled to 100 MiB.
    copies = {k: v["median"] for k, v in tn["memcpy_256MiB"].items() if v.get("n")}
    fastest = min(copies, key=copies.get)
    memcpy_100 = copies[fastest] * BIG_BYTES / MEMCPY_BYTES
    r = {"memcpy_fastest": fastest, "memcpy_100MiB_equiv_s": memcpy_100}
    for k, v in s.items():
        r[f"{k} / memcpy(100 MiB)"] = v["returned"]["median"] / memcpy_100
    for n in tn["sizes"]:
        nb = s[f"nbdist_exec_n{n}"]["touched"]
        r[f"torch_queue_private / nbdist_exec_n{n} (touched)"] = ratio(
            s["torch_queue_private"]["touched"], nb)
        r[f"mp_queue_pickle / nbdist_exec_n{n} (touched)"] = ratio(
            s["mp_queue_pickle"]["touched"], nb)
    return {"tensor": r}


def print_table(res):
    tn = res.get("tensor", {})
    if not tn.get("summary"):
        return
    print("\n-- a 100 MiB float32 tensor from rank 0 / a child to the caller (returned; "
          "+ every page read)")
    for k, v in tn["summary"].items():
        print(f"   {k:<44} {fmt_summary(v['returned'])}; touched {fmt_summary(v['touched'])}")
    for k, v in tn["memcpy_256MiB"].items():
        print(f"   memcpy 256 MiB, 1 thread: {k:<20} {fmt_summary(v)} = "
              f"{MEMCPY_BYTES / v['median'] / 1e9:.1f} GB/s")
    r = ratios(res)["tensor"]
    print(f"   the limit, the fastest copy of this run: {r['memcpy_fastest']}, 100 MiB in "
          f"{fmt(r['memcpy_100MiB_equiv_s'], ms=True)}")


if __name__ == "__main__":
    sys.exit(harness.run_alone(sys.modules[__name__]))
