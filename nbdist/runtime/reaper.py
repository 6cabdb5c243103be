"""Kill and reap: the one way the notebook's side ends processes it gave up on.

Every process a rank, a spare or a generation ran in ends here (:func:`reap`): SIGKILL to each
still running (for a rank started elsewhere, its watchdog is asked to kill it), then one wait for
all of them together against one :class:`~nbdist.wire.deadline.Deadline`, then the handles
released and, for ranks, their control channels closed. A process on an unreachable host costs
what is left of the deadline once, not a wait of its own; what did not end in time is returned, so
the caller can say what it left and why.

Threads: the thread that owns the processes (the group's holder, the prewarm thread for spares, a
failed start). ``kill`` itself is safe from any thread (:mod:`.processes`).
"""
from __future__ import annotations

from typing import Iterable, List, Optional

from ..wire.deadline import Deadline
from .processes import Process

__all__ = ["reap", "reap_ranks"]


def reap(processes: Iterable[Process], deadline: Deadline,
         asked: Optional[Deadline] = None) -> List[Process]:
    """SIGKILL every process of ``processes`` still running -- those told to exit first get until
    ``asked`` to do so --, wait for them all until ``deadline`` (a passed deadline still gives
    what was just killed :data:`KILLED_S` s, once for all), release the handles of those that
    ended. Returns those still running (their handles kept)."""
    procs = [p for p in processes if p is not None]
    if asked is not None:
        for p in procs:
            if p.exit_status is None:
                p.join(asked.left())
    for p in procs:
        if p.exit_status is None:
            p.kill()
    killed = Deadline(KILLED_S)  # a passed deadline still gives what was killed this moment
    for p in procs:
        if p.exit_status is None:
            p.join(max(deadline.left() or 0.0, killed.left()))
    left = []
    for p in procs:
        if p.exit_status is None:
            left.append(p)
        else:
            p.release()
    return left


#: how long a SIGKILLed local process is waited for once the deadline has passed (the kernel
#: needs a moment to end it; a remote process that does not answer costs this once)
KILLED_S = 0.2


def reap_ranks(ranks: Iterable, deadline: Deadline, asked: Optional[Deadline] = None,
               relay=None, streams_s: float = 0.0) -> List[int]:
    """:func:`reap` the processes of ``ranks`` (:class:`~nbdist.runtime.ranks.Rank` s), close their
    channels, and -- given their ``relay`` -- wait up to ``streams_s`` s more (all ranks together,
    no more than is left of ``deadline``, but :data:`KILLED_S` at least) for their last lines.
    Returns the ranks whose process was still running."""
    ranks = list(ranks)
    left = set(map(id, reap([r.process for r in ranks], deadline, asked)))
    for r in ranks:
        if r.channel is not None:
            r.channel.close()
    if relay is not None:
        budget = deadline.left()
        streams = Deadline(streams_s if budget is None else min(streams_s, max(budget, KILLED_S)))
        for r in ranks:
            relay.wait_closed(r.rank, streams.left())
    return [r.rank for r in ranks if id(r.process) in left]
