"""Sizes, units and the bandwidth arithmetic of nccl-tests: pure functions, no torch.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md`` there). For a message of ``S`` bytes that takes
``t`` seconds, the *algorithm bandwidth* is ``algbw = S / t``. The *bus bandwidth* scales it by what
an optimal algorithm must move over the slowest link, so that one number compares across ops and
world sizes ``n``: ``busbw = algbw * factor`` with

=================================================  =====================
op                                                 factor
=================================================  =====================
all_reduce                                         ``2 (n - 1) / n``
all_gather, reduce_scatter, all_to_all             ``(n - 1) / n``
broadcast, reduce, send_recv                       ``1``
barrier                                            none (latency only)
=================================================  =====================

``S`` is the size of the largest buffer: the tensor for all_reduce, broadcast and reduce, the
gathered output for all_gather, the input for reduce_scatter and all_to_all, the message for
send_recv. GB/s means 10**9 bytes per second, as in nccl-tests.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from ..report.units import (GiB, KiB, MiB, format_bytes, format_rate, format_time, parse_size,
                            parse_sizes, percentile)

_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
    "barrier": lambda n: None,
}
OPS: Tuple[str, ...] = tuple(_FACTORS)
"""Every op the benchmark knows, in the order a sweep runs them."""


def parse_ops(spec: Union[None, str, Sequence[str]]) -> List[str]:
    """Op names from ``None`` (all of :data:`OPS`), ``"all_reduce,barrier"`` or a list."""
    if spec is None:
        return list(OPS)
    names = [p.strip() for p in spec.split(",")] if isinstance(spec, str) else list(spec)
    names = [n for n in names if n]
    unknown = [n for n in names if n not in _FACTORS]
    if unknown or not names:
        raise ValueError(f"unknown op{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown)) or '(none given)'}; "
                         f"valid ops: {', '.join(OPS)}")
    return list(dict.fromkeys(names))


def bus_factor(op: str, world_size: int) -> Optional[float]:
    """nccl-tests' bus-bandwidth factor of ``op`` on ``world_size`` ranks (``None``: barrier)."""
    return _FACTORS[op](world_size)


def bandwidths(op: str, nbytes: int, seconds: Optional[float],
               world_size: int) -> Tuple[Optional[float], Optional[float]]:
    """``(algbw, busbw)`` in GB/s (10**9 B/s); ``(None, None)`` for barrier or no time."""
    factor = bus_factor(op, world_size)
    if factor is None or not seconds or not nbytes:
        return None, None
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * factor
