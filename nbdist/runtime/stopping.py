"""How ``Group.stop(timeout)`` gets the group from whichever thread holds it, and what it says
about ranks it could not end: the stop's half of the threading model (:mod:`nbdist.runtime`).

A stop from another thread waits for the holder (a call, a start, a job settling) politely until
only :data:`~nbdist.runtime.group.STOP_WAIT` s of its time are left; then it stops what the
holder does -- kills that call's ranks and ends a pdb prompt that waits for the user, or closes
the launcher of a start -- and waits for the holder with the rest, while the holder tears the
group down within the stop's time (``Group._stop_by``).
"""
from __future__ import annotations

from typing import Dict, Optional

from ..errors import DistTimeoutError, ranks_phrase
from ..wire.deadline import Deadline
from . import rankpdb

__all__ = ["acquire", "left_behind"]


def acquire(group, budget: Optional[float], deadline: Deadline, keep: float) -> bool:
    """Take ``group``'s lock for its ``stop()`` (``budget``: the stop's seconds, ``None``: wait
    as long as it takes), politely until ``keep`` s are left; False if the holder still has it
    when ``deadline`` passes (``group._doing`` then says what the holder was doing)."""
    if budget is None:
        return group._lock.acquire()
    if group._lock.acquire(timeout=max(0.0, deadline.left() - keep)):
        return True
    group._stop_requested = True  # the thread holding the group checks it at each step
    rs = group._rs
    if group._stopping or (rs is None and not group._launching):
        group._doing = "stopping ranks"  # a stop or restart that waits for unreachable ranks
    elif rs is not None:
        rs.kill(range(len(rs.ranks)))  # handles stay with the call's thread
        call = group._last_call
        group._doing = f"running '{getattr(call, 'what', 'a call')}', whose ranks were killed"
        rankpdb.end_prompt(call)  # a pdb prompt waiting for the user ends
    else:  # an attached group's wait for torchrun's next generation
        group._launcher.close()  # ends as its launcher closes
        group._doing = "starting ranks"
    return group._lock.acquire(timeout=deadline.left())


def left_behind(left: Dict[int, str], budget: float) -> DistTimeoutError:
    """The error of a stop that stopped the group but could not confirm ``left`` ended
    (``{rank: why}``) within ``budget`` s."""
    said = "; ".join(f"rank {r}: {why}" for r, why in sorted(left.items()))
    return DistTimeoutError(
        f"the group is stopped, but {ranks_phrase(left)} could not be confirmed gone within "
        f"{budget:g} s: {said}. Nothing on this side "
        "waits for them any more; a rank that is still running ends when it notices its "
        "controller is gone.", sorted(left))
