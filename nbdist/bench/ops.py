"""What runs on the ranks: one op at one size -- check the result once, warm up, time.

:func:`measure` is shipped by reference (``g.call(measure, ...)``), so it runs the same code on
every rank. It returns this rank's raw per-iteration times; the caller takes the slowest rank per
iteration (:func:`nbdist.bench.sweep.summarize`).

Method (the same for every op):

1. allocate the buffers for ``nbytes`` (rounded down to whole elements, and to a multiple of the
   world size for ops that split a buffer among ranks);
2. run the op once with known inputs and check the output (``verified``). An exception from the
   backend here means the backend lacks the op (or the dtype): the op is reported unsupported;
3. run ``warmup`` iterations, not measured;
4. align the ranks with a barrier, then time ``iters`` back-to-back iterations, taking a timestamp
   after each (``time.perf_counter`` on CPU; CUDA events on the current stream on GPU, read after
   one synchronisation at the end of the block).

After the check, buffers that reductions update in place are zero-filled, so their values never grow
(overflow, or turn into slow special values) during the measurement.
"""
from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

_SPLIT = ("all_gather", "reduce_scatter", "all_to_all")  # buffers divided among the ranks
_NOTE_CHARS = 300

# torch 2.13 renamed the tensor forms; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _all(t: torch.Tensor, value: float) -> bool:
    return bool((t.to(torch.float64) == value).all())


def _all_then_zero(t: torch.Tensor, value: float) -> bool:
    ok = _all(t, value)
    t.zero_()  # in-place ops would otherwise grow the values iteration after iteration
    return ok


def _chunks_are_ranks(out: torch.Tensor, n: int) -> bool:
    parts = out.view(n, -1).to(torch.float64)
    return all(bool((parts[j] == j).all()) for j in range(n))


Case = Tuple[int, Callable[[], Any], Callable[[], bool]]


def setup(op: str, nbytes: int, dtype: torch.dtype, dev: torch.device) -> Case:
    """Buffers for ``op`` at ``nbytes``: return ``(count, run, check)``.

    ``run()`` does one op; ``check()`` (called once, after the first ``run()``) says whether the
    output holds the expected values, and resets the buffers to zeros for the timed loop.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    elem = torch.empty((), dtype=dtype).element_size()
    count = nbytes // elem
    count = max(n, count // n * n) if op in _SPLIT else max(1, count)

    def full(numel: int, value: float) -> torch.Tensor:
        return torch.full((numel,), value, dtype=dtype, device=dev)

    if op == "all_reduce":
        x = full(count, 1)
        return count, lambda: dist.all_reduce(x), lambda: _all_then_zero(x, n)
    if op == "all_gather":
        inp, out = full(count // n, rank), full(count, n)  # n: no rank sends it
        return count, lambda: _all_gather(out, inp), lambda: _chunks_are_ranks(out, n)
    if op == "reduce_scatter":
        inp, out = full(count, 1), full(count // n, 0)
        return count, lambda: _reduce_scatter(out, inp), lambda: _all(out, n)
    if op == "all_to_all":
        inp, out = full(count, rank), full(count, n)
        return count, lambda: dist.all_to_all_single(out, inp), lambda: _chunks_are_ranks(out, n)
    if op == "broadcast":
        x = full(count, 1 if rank == 0 else 0)
        return count, lambda: dist.broadcast(x, 0), lambda: _all(x, 1)
    if op == "reduce":
        x = full(count, 1)
        # only the root's result is defined; the others' buffers may serve as scratch space
        return count, lambda: dist.reduce(x, 0), lambda: _all_then_zero(x, n) or rank != 0
    if op == "barrier":
        return 0, dist.barrier, lambda: True
    assert op == "send_recv", op  # callers check names with units.parse_ops
    return (count,) + _ping_pong(rank, full(count, rank + 1), full(count, 0))


def peak_bytes(op: str, nbytes: int, dtype: str, world_size: int) -> int:
    """About the most memory :func:`measure` holds on one rank for ``op`` at ``nbytes``: the
    buffers :func:`setup` allocates, and during the check a float64 copy of the output and its
    mask (:func:`_all`)."""
    if op == "barrier":
        return 0
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    buffers = {"all_to_all": 2.0, "send_recv": 2.0, "all_gather": 1.0 + 1.0 / world_size,
               "reduce_scatter": 1.0 + 1.0 / world_size}.get(op, 1.0)
    return int(nbytes * (buffers + 9.0 / elem))  # float64 (8 bytes) and bool (1) per element


def free_memory(device: str) -> Tuple[str, int]:
    """``(where, bytes)`` this rank can allocate its buffers in: free memory of its GPU, or the
    host's available RAM (shared by the ranks of that host)."""
    import socket

    if device == "cuda":
        index = torch.cuda.current_device()
        return f"{socket.gethostname()} cuda:{index}", torch.cuda.mem_get_info(index)[0]
    import psutil

    return socket.gethostname(), psutil.virtual_memory().available


def _ping_pong(rank: int, mine: torch.Tensor, got: torch.Tensor):
    """Rank 0 sends to rank 1, which sends back; other ranks take no part."""
    if rank == 0:
        def run():
            dist.send(mine, 1)
            dist.recv(got, 1)
    elif rank == 1:
        def run():
            dist.recv(got, 0)
            dist.send(mine, 0)
    else:
        return (lambda: None), (lambda: True)
    return run, lambda: _all(got, 2 - rank)


def _timestamps(run: Callable[[], Any], iters: int, dev: torch.device) -> List[float]:
    """Per-iteration durations (s) of ``iters`` back-to-back ``run()`` calls."""
    if dev.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            run()
            events[i + 1].record()
        torch.cuda.synchronize(dev)
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(iters)]
    clock = time.perf_counter
    stamps = [0.0] * (iters + 1)
    stamps[0] = clock()
    for i in range(iters):
        run()
        stamps[i + 1] = clock()
    return [b - a for a, b in zip(stamps, stamps[1:])]


def measure(op: str, nbytes: int, dtype: str, iters: int, warmup: int,
            device: str) -> Dict[str, Any]:
    """Check, warm up and time ``op`` on this rank; return a dict of raw results.

    Keys: ``status`` ("ok" or "unsupported"), ``count``, ``bytes``, ``verified``, ``note``, and
    ``times`` (per-iteration seconds; ``None`` on ranks that take no part, as in send_recv).
    """
    dev = _device(device)
    torch_dtype = getattr(torch, dtype)
    count, run, check = setup(op, nbytes, torch_dtype, dev)
    elem = torch.empty((), dtype=torch_dtype).element_size()
    out: Dict[str, Any] = {"count": count, "bytes": count * elem, "times": None,
                           "verified": None, "note": None}
    try:
        run()
        _sync(dev)
    except Exception as err:  # noqa: BLE001 -- whatever the backend raises means "not here"
        first_line = (str(err).strip().splitlines() or [""])[0]
        out.update(status="unsupported", note=f"{type(err).__name__}: {first_line}"[:_NOTE_CHARS])
        return out
    out.update(status="ok", verified=check())
    for _ in range(warmup):
        run()
    _sync(dev)
    dist.barrier()  # align the ranks before the measured block
    times = _timestamps(run, iters, dev)
    if op == "send_recv":
        if dist.get_rank() > 1:
            return out
        times = [t / 2 for t in times]  # one way = half the round trip
    out["times"] = times
    return out


COPIES = ("memmove", "torch copy_", "numpy.copyto")
"""The ways :func:`memcpy_all` copies a buffer: libc's ``memmove`` (through ctypes), torch's
``Tensor.copy_`` and ``numpy.copyto``. Which is fastest depends on the machine and its libraries."""


def memcpy_all(nbytes: int, repeats: int) -> Dict[str, float]:
    """Copy bandwidth in GB/s of each way in :data:`COPIES`, on one thread: a copy of ``nbytes``
    into a buffer that already exists, median of ``repeats`` after one untimed copy (which also
    faults the pages in). The ways take turns within each repeat, so that load hits them alike.
    Without numpy (torch does not require it) the numpy way is left out."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ways = {"memmove": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
            "torch copy_": lambda: dst.copy_(src)}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        nsrc, ndst = src.numpy(), dst.numpy()
        ways["numpy.copyto"] = lambda: np.copyto(ndst, nsrc)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times: Dict[str, List[float]] = {k: [] for k in ways}
        for copy in ways.values():
            copy()
        for _ in range(repeats):
            for name, copy in ways.items():
                start = time.perf_counter()
                copy()
                times[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return {k: nbytes / sorted(v)[len(v) // 2] / 1e9 for k, v in times.items()}

