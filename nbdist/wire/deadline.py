"""One deadline, shared by every step of a bounded wait: the time left, and the poll loop.

A teardown or a settle is a chain of waits (a reply, a reap, the streams' end...). Each wait
used to start its own clock, so the chain took the sum of them. A :class:`Deadline` is made once,
where the budget is known, and handed down: each step waits only for what is left of it, and a
step that finds it passed does what it can at once and goes on (never waits, never raises).

:func:`poll_until` is the one loop "do a bounded step until something is true or the time is up"
(read replies until the ranks answered; sleep until the spares imported torch...).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["Deadline", "WAKE_S", "poll_until"]

#: the longest a wait that Ctrl-C must be able to end blocks in one go. The OS hands a SIGINT sent
#: to the process to any thread that does not block it -- the main thread nearly always, another
#: now and then -- and Python runs the handler (``KeyboardInterrupt``) only once the main thread
#: runs Python code again: a main thread blocked in ``select()`` or on a lock with no timeout would
#: sleep through it until something else woke it.
WAKE_S = 0.25


class Deadline:
    """``seconds`` from now (``None``: never). Cheap to pass around; never raises."""

    def __init__(self, seconds: Optional[float]):
        self.at: Optional[float] = None if seconds is None else time.monotonic() + seconds

    @classmethod
    def earliest(cls, *deadlines: "Optional[Deadline]") -> "Deadline":
        """A deadline at the earliest of ``deadlines`` (``None`` entries and never-deadlines are
        ignored; none left: never)."""
        ats = [d.at for d in deadlines if d is not None and d.at is not None]
        made = cls(None)
        made.at = min(ats) if ats else None
        return made

    def left(self, cap: Optional[float] = None) -> Optional[float]:
        """Seconds left, never below 0 (``None`` for a never-deadline), at most ``cap``."""
        if self.at is None:
            return cap
        left = max(0.0, self.at - time.monotonic())
        return left if cap is None else min(left, cap)

    def passed(self) -> bool:
        """True once the time is up."""
        return self.at is not None and time.monotonic() >= self.at

    def __repr__(self) -> str:
        left = self.left()
        return "<Deadline never>" if left is None else f"<Deadline in {left:.3f} s>"


def poll_until(done: Callable[[], bool], step: Callable[[Optional[float]], object],
               deadline: Deadline, cap: Optional[float] = None) -> bool:
    """Run ``step(seconds)`` -- a wait of at most ``seconds`` (``None``: as long as it likes),
    the time left, at most ``cap`` -- until ``done()`` or the deadline passed; whether ``done()``.
    ``done()`` is asked first: nothing waits for what is already true."""
    while not done():
        if deadline.passed():
            return False
        step(deadline.left(cap))
    return True
