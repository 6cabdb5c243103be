"""Where a training step's time goes, per rank: ``with nbdist.step(i): ...`` on the ranks.

The block runs under the collective trace (:func:`nbdist.bench.trace`: torch's profiler, so the
collectives DDP and FSDP issue from their hooks count too). On exit three scalars go to
``nbdist.log`` at step ``i``: ``step_s`` (the block's wall time), ``comm_s`` (the time covered by
collectives, each from its call to the end of its execution -- so the time it waits in the
backend's queue counts, as the rank is waiting on it -- their intervals merged, so overlapping
ones count once) and ``compute_s``
(the rest: compute, data, Python). Communication that overlaps compute counts as communication.
Starting and stopping the profiler costs about 2 ms per step on a small CPU machine; that happens
outside the timed block, so it lengthens the run but not the figures.

In the caller, :meth:`nbdist.Metrics.stragglers` names the ranks whose compute time is at least
``factor`` (1.25) times the median over the ranks, over the last ``window`` steps; a job's status
line, repr and live view say so.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, List, Optional, Tuple

from ..runtime.ranklog import log
from .trace import trace


def merged_length(intervals: List[Tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of ``intervals``, clipped to ``[lo, hi]``."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals):
        if b <= a or b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@contextlib.contextmanager
def step(n: Optional[int] = None) -> Iterator[None]:
    """Time one training step on this rank and log ``step_s``, ``comm_s`` and ``compute_s``.

    Call it on the ranks, inside a call on a group: ``with nbdist.step(i): loss = train_step()``.
    """
    with trace(shapes=False) as tr:
        begin, t0 = time.time(), time.perf_counter()
        yield
        wall = time.perf_counter() - t0
    comm = merged_length([(min(e["issued"], e["start"]), e["start"] + e["duration"])
                          for e in tr.events], begin, begin + wall)
    log(step=n, step_s=wall, comm_s=comm, compute_s=max(0.0, wall - comm))
