"""The caller's side of the benchmark: sweep ops x sizes on a group, compare configurations.

Each (op, size) point is one call on the group (:func:`nbdist.bench.ops.measure` on every rank),
so a sweep shows a progress bar and a dead or stuck rank is reported like any other call. The
ranks return raw per-iteration times; :func:`summarize` turns them into one record.
"""
from __future__ import annotations

import statistics
from typing import Any, Dict, Iterable, Optional, Sequence, Union

from ..errors import ranks_phrase
from .records import FIELDS, NOISY_SPREAD, Records
from .units import (GiB, KiB, MiB, bandwidths, format_bytes, parse_ops, parse_size,
                    parse_sizes, percentile)

DEFAULT_SIZES = "4K-64M"
"""Sizes a sweep uses when none are given (every power of two from 4 KiB to 64 MiB)."""


def _check_dtype(dtype: Any) -> str:
    import torch

    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype) or dt.is_complex or dt == torch.bool:
        raise ValueError(f"dtype must be a real floating-point or integer torch dtype, such as "
                         f"torch.float32 or 'bfloat16'; got {dtype!r}")
    return name


def _check_count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int of at least {least}, got {value!r}")
    return value


def summarize(op: str, results: Sequence[Dict[str, Any]], **meta) -> Dict[str, Any]:
    """One record from the ranks' raw results of :func:`nbdist.bench.ops.measure`.

    Per iteration the op's time is the slowest rank's; ``time_s`` is the median of those (the
    typical latency), ``p10_s``/``p90_s`` their percentiles, ``rank_min_s``/``rank_max_s`` the
    fastest and slowest rank's own median. The bandwidths are ``bytes / time_s``: the same
    statistic as the time shown next to them, and one that a few preempted iterations (a rank
    that lost its core for a scheduler slice) do not move. ``mean_s`` (the slowest rank's block
    time / iters, what nccl-tests divides by) is kept for reference; it includes those spikes.
    ``spiked`` is the share of iterations slower than ``NOISY_SPREAD * p10_s``; ``noisy`` is
    True when ``p90_s > NOISY_SPREAD * p10_s`` (more than a tenth spiked): the iterations
    disagree, so the point is worth measuring again. ``meta`` supplies world_size, backend,
    device, dtype, iters, warmup.
    """
    first = results[0]
    rec = _empty_record(op, first["bytes"], first["count"], meta)
    bad = [(r, res) for r, res in enumerate(results) if res["status"] != "ok"]
    if bad:
        ranks = [r for r, _ in bad]
        rec.update(status="unsupported", verified=None,
                   note=f"{ranks_phrase(ranks)}: "
                        f"{bad[0][1]['note']}")
        return rec
    timed = [res["times"] for res in results if res["times"]]
    per_iter = [max(column) for column in zip(*timed)]
    rank_medians = [statistics.median(t) for t in timed]
    rec.update(time_s=statistics.median(per_iter), mean_s=max(map(statistics.fmean, timed)),
               p10_s=percentile(per_iter, 10), p90_s=percentile(per_iter, 90),
               rank_min_s=min(rank_medians), rank_max_s=max(rank_medians))
    rec["spiked"] = sum(t > NOISY_SPREAD * rec["p10_s"] for t in per_iter) / len(per_iter)
    rec["noisy"] = rec["p90_s"] > NOISY_SPREAD * rec["p10_s"]
    rec["algbw_GBps"], rec["busbw_GBps"] = bandwidths(op, rec["bytes"], rec["time_s"],
                                                      meta["world_size"])
    wrong = [r for r, res in enumerate(results) if res["verified"] is False]
    note = (f"the result differed from the expected values on {ranks_phrase(wrong)}"
            if wrong else None)
    rec.update(status="wrong" if wrong else "ok", verified=not wrong, note=note)
    return rec


def _empty_record(op: str, nbytes: int, count: Optional[int], meta) -> Dict[str, Any]:
    rec = dict.fromkeys(FIELDS)
    rec.update(op=op, bytes=nbytes, count=count,
               **{k: meta[k] for k in ("dtype", "world_size", "backend", "device", "iters",
                                       "warmup")})
    return rec


def collectives(group, ops: Union[None, str, Sequence[str]] = None,
                sizes: Union[str, int, Iterable] = DEFAULT_SIZES, dtype: Any = "float32",
                iters: int = 50, warmup: int = 10, progress: bool = True,
                timeout: Optional[float] = None) -> Records:
    """Benchmark collectives on ``group``; return one record per (op, size) as :class:`Records`.

    Args:
        group: a started :class:`nbdist.Group`.
        ops: names from :data:`nbdist.bench.OPS` (a list or ``"all_reduce,barrier"``); default all.
        sizes: message sizes in bytes, e.g. ``"4K-64M"`` (see :func:`parse_sizes`).
        dtype: element type, e.g. ``"float32"`` or ``torch.bfloat16``.
        iters: measured iterations per point; ``warmup``: iterations run before, not measured.
            The defaults (50 and 10) keep the median steady on a shared 2-core machine, where a
            rank that loses its core for a scheduler slice adds milliseconds to an iteration.
        progress: show a progress bar (tqdm: a widget in notebooks, text in terminals).
        timeout: deadline in seconds for each point (default: the group's ``call_timeout``).

    An op the backend lacks gets ``status="unsupported"`` (with the backend's message in
    ``note``); a result that fails its check gets ``status="wrong"``. Nothing is raised for them.
    """
    from . import ops as rank_ops

    names = parse_ops(ops)
    size_list = parse_sizes(sizes)
    meta = dict(dtype=_check_dtype(dtype), iters=_check_count("iters", iters, 1),
                warmup=_check_count("warmup", warmup, 0), world_size=group.world_size,
                backend=group.backend, device=group.device)
    _check_memory(group, names, size_list, meta)
    points = [(op, size) for op in names for size in ([0] if op == "barrier" else size_list)]
    records = Records()
    with _progress(len(points), f"{meta['backend']} x{meta['world_size']}", progress) as bar:
        for op, size in points:
            bar.set_postfix_str(f"{op} {format_bytes(size) if size else ''}".strip(), refresh=False)
            if op == "send_recv" and group.world_size < 2:
                rec = _empty_record(op, size, None, meta)
                rec.update(status="unsupported", note="send_recv needs at least 2 ranks (a "
                           "ping-pong between ranks 0 and 1)")
                records.append(rec)
            else:
                results = group.call(rank_ops.measure, (op, size, meta["dtype"], iters, warmup,
                                                        meta["device"]), timeout=timeout)
                records.append(summarize(op, results, **meta))
            bar.update(1)
    return records


_USABLE = 0.8  #: the share of a host's available memory a sweep's buffers may take


def _check_memory(group, names: Sequence[str], sizes: Sequence[int], meta) -> None:
    """Refuse sizes whose buffers cannot fit where the ranks run, before any is allocated: one
    small call asks each rank how much memory it can use (its GPU's, or its host's, shared by
    the ranks there). A ``ValueError`` names the size, the need and what is available."""
    from . import ops as rank_ops

    sized = [op for op in names if op != "barrier"]
    if not sized:
        return
    largest, n = max(sizes), meta["world_size"]
    need, op = max((rank_ops.peak_bytes(o, largest, meta["dtype"], n), o) for o in sized)
    ranks: Dict[str, int] = {}
    available: Dict[str, int] = {}
    for where, free in group.call(rank_ops.free_memory, (meta["device"],)):
        ranks[where] = ranks.get(where, 0) + 1
        available[where] = free
    for where, count in ranks.items():
        usable = available[where] * _USABLE
        if need * count <= usable:
            continue
        fit = 1 << max(0, int(largest * usable / (need * count)).bit_length() - 1)
        raise ValueError(
            f"the largest size, {format_bytes(largest)}, does not fit in memory: {op} at that size "
            f"needs about {format_bytes(need)} on each rank (its buffers, and a float64 copy to "
            f"check the result), {format_bytes(need * count)} for the {count} "
            f"rank{'s' if count > 1 else ''} on {where}, which has "
            f"{format_bytes(available[where])} available (a sweep uses at most "
            f"{_USABLE:.0%}). Use sizes up to {format_bytes(fit)} here, e.g. "
            f"'{_spec(min(4 * KiB, fit))}-{_spec(fit)}'.")


def _spec(nbytes: int) -> str:
    """A power of two as a size spec writes it: ``8 << 30`` -> ``"8G"``."""
    for unit, size in (("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes >= size:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, unit="pt")


_CONFIG_KEYS = ("world_size", "backend", "device")


def compare(group, configs: Sequence[Dict[str, Any]], **sweep) -> Records:
    """Run the same sweep once per configuration; return all records in one :class:`Records`.

    ``configs`` is a list of dicts with any of ``world_size``, ``backend`` and ``device``, e.g.
    ``[{"backend": "gloo"}, {"backend": "nbstore"}, {"world_size": 4}]``; what a dict leaves out
    stays as the group had it (``{}`` is the group as it was). The group is restarted whenever a
    configuration differs from the running one, and put back as it was at the end. ``sweep`` takes
    :func:`collectives`' arguments. Every configuration is checked before anything runs.
    """
    from ..backends import resolve_backend

    if (isinstance(configs, (str, dict)) or not isinstance(configs, Sequence) or not configs
            or not all(isinstance(c, dict) for c in configs)):
        raise TypeError("configs must be a non-empty list of dicts of restart() options, e.g. "
                        "[{'backend': 'gloo'}, {'world_size': 4}]")
    for config in configs:
        unknown = sorted(set(config) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"compare() configs may set {', '.join(_CONFIG_KEYS)}; config "
                             f"{config} also has {', '.join(unknown)}")
        resolve_backend(config.get("backend", group.backend), config.get("device", group.device))
    original = {"world_size": group.world_size, "backend": group.backend, "device": group.device}
    current = dict(original)
    out = Records()
    try:
        for config in configs:
            target = dict(original, **config)
            if target != current:
                group.restart(**target)
                current = target
            out.extend(collectives(group, **sweep))
    finally:
        if current != original:
            group.restart(**original)
    return out


def memcpy_bandwidth(group=None, nbytes: int = 64 * MiB, repeats: int = 5,
                     each: bool = False) -> Union[float, Dict[str, float]]:
    """Single-core memory copy bandwidth of this machine in GB/s (10**9 B/s).

    ``nbytes`` copied between two CPU buffers on one thread, three ways (libc ``memmove``,
    torch's ``copy_``, ``numpy.copyto``; they take turns), median of ``repeats`` each; the
    result is the fastest of the three: the most data one core moves through memory per second,
    the limit a CPU collective's bandwidth is held against. (Which way wins varies: one
    library's copy can be half as fast as another's on the same machine.) ``each=True`` returns
    all three as ``{way: GB/s}``. With a ``group`` it runs on rank 0 (the ranks' environment);
    otherwise here.
    """
    from . import ops as rank_ops

    nbytes = parse_size(nbytes) if isinstance(nbytes, str) else _check_count("nbytes", nbytes, 1)
    _check_count("repeats", repeats, 1)
    if group is None:
        ways = rank_ops.memcpy_all(nbytes, repeats)
    else:
        ways = group.call(rank_ops.memcpy_all, (nbytes, repeats), ranks=[0])[0]
    return dict(ways) if each else max(ways.values())
