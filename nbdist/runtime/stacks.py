"""Every rank's Python stack, taken while the rank runs: ``Group.stacks()``, ``%dist_stacks``, and
the stacks a :class:`~nbdist.errors.DistTimeoutError` carries.

On a rank, the watchdog thread -- not the main thread, which may be stuck in a collective, a
``time.sleep`` or a data loader -- reads the request the notebook sends down the lifeline
(``S<n>;``: the main thread, ``A<n>;``: every thread; :meth:`nbdist.wire.relay.Lifeline.stacks`),
and a short-lived thread takes the stacks and sends them over the control channel as
``("stacks", n, body, [])`` (:func:`capture`, :func:`send_later`). On the notebook's side, whichever thread reads that rank's
channel posts it to the rank set's :class:`StacksBox`: a waiting call, a background job's thread,
or :func:`collect` itself when the group is idle.

The stacks leave out nbdist's own serving frames: a rank that waits for a request shows as idle.
Ranks whose stacks are the same are shown once (:class:`Stacks`: ``ranks 0, 2, 3: Cell In[4]:3
<module> -> distributed_c10d.py:2950 all_reduce``).
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import traceback
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..errors import ranks_phrase
from ..wire import locks
from ..wire.deadline import Deadline, poll_until
from . import cells, reader, recorder

_NBDIST = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: where nbdist's own serving loop lives on a rank: frames a user is not shown (here and in
#: :mod:`.postmortem`)
SERVING = tuple(os.path.join(_NBDIST, part) + os.sep for part in ("runtime", "wire"))
_RECORDER = os.path.join(_NBDIST, "runtime", "recorder.py")  # its wrapper: not a frame to show
_numbers = itertools.count(1)


# ---- on the rank --------------------------------------------------------------------------------
def capture(all_threads: bool) -> Dict[str, Any]:
    """The stack of this process's main thread (every thread's with ``all_threads``), as plain
    data: ``{"threads": [{"name", "main", "frames": [(file, line, function, text)]}], ...}``.
    Called on a thread of nbdist's (:func:`send_later`), which, like the watchdog, is left out."""
    main, me = threading.main_thread().ident, threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        if ident == me or (not all_threads and ident != main) or \
                names.get(ident, "").startswith("nbdist-"):  # our own helpers: not yours
            continue
        frames = [(f.filename, f.lineno, f.name, (f.line or "").strip())
                  for f in traceback.extract_stack(frame) if f.filename != _RECORDER]
        threads.append({"name": names.get(ident, f"thread {ident}"), "main": ident == main,
                        "frames": _user_frames(frames) if ident == main else frames})
    threads.sort(key=lambda t: not t["main"])
    return {"threads": threads, "time": time.time(), "pid": os.getpid(), "all": all_threads,
            "collectives": recorder.snapshot()}


def _user_frames(frames: List[tuple]) -> List[tuple]:
    """The main thread's frames after nbdist's serving loop (and what started the process): the
    code a request runs, or nothing while the rank waits for one."""
    start = next((i for i, f in enumerate(frames) if f[0].startswith(SERVING)), None)
    if start is None:
        return frames  # not under nbdist's loop
    end = start
    while end < len(frames) and frames[end][0].startswith(SERVING):
        end += 1
    return frames[end:]


def send_later(channel, n: int, all_threads: bool) -> None:
    """Take stacks ``n`` (:func:`capture`) and send them from a thread of their own: the control
    channel may be busy with a large reply, and the watchdog must stay free to read the next
    command -- nothing a stack request does can end the watchdog (an error taking the stacks
    ends this thread only, and Python prints it on the rank's stderr)."""
    def run():
        body = capture(all_threads)
        try:
            channel.send(("stacks", n, body, []))
        except (OSError, ValueError):
            pass  # the controller is gone: the watchdog notices
    threading.Thread(target=run, name="nbdist-stacks", daemon=True).start()


# ---- on the notebook's side ---------------------------------------------------------------------
class StacksBox:
    """Stacks the ranks sent, by request number and rank, until the asker takes them. Any thread
    posts (the one reading the rank's channel); the asker waits. Its lock is a leaf."""

    def __init__(self):
        self._cond = threading.Condition(locks.make("stacks"))
        self._got: Dict[Tuple[int, int], Dict[str, Any]] = {}

    def post(self, n: int, rank: int, body: Dict[str, Any]) -> None:
        """Rank ``rank``'s answer to request ``n``."""
        with self._cond:
            self._got[(n, rank)] = body
            self._cond.notify_all()

    def answered(self, n: int, ranks: Iterable[int]) -> List[int]:
        """The ranks among ``ranks`` that answered request ``n`` so far (nothing removed)."""
        with self._cond:
            return [r for r in ranks if (n, r) in self._got]

    def take(self, n: int, ranks: Iterable[int]) -> Dict[int, Dict[str, Any]]:
        """The answers to request ``n`` that came, removed from the box."""
        with self._cond:
            return {r: self._got.pop((n, r)) for r in ranks if (n, r) in self._got}

    def wait(self, n: int, ranks: List[int], timeout: float) -> None:
        """Until every rank in ``ranks`` answered request ``n``, or ``timeout`` s passed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all((n, r) in self._got for r in ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)


def ask(rs, ranks: Iterable[int], all_threads: bool = False) -> Tuple[int, List[int]]:
    """Ask ``ranks`` for their stacks; the request's number and the ranks that were asked (a rank
    without a live lifeline cannot answer)."""
    n = next(_numbers)
    asked = []
    for r in ranks:
        lifeline = rs.relay.lifeline(r)
        if lifeline is not None and lifeline.stacks(n, all_threads):
            asked.append(r)
    return n, asked


def collect(rs, n: int, asked: List[int], timeout: float, read: bool) -> Dict[int, Any]:
    """The answers to request ``n`` within ``timeout`` s. ``read``: this thread reads the ranks'
    channels itself (the group is idle and its lock is held), through the one reader
    (:mod:`.reader`: whatever else comes is handled as any reader would); otherwise the thread
    waiting on the running call reads them and posts to the box. Either way the box says who
    answered -- answers another thread read before this one took the channels included."""
    if read:
        idle = reader.Waiter()  # no call: late replies go back, a rank lost is left alone
        poll_until(lambda: not _unanswered(rs, n, asked, idle.dead),
                   lambda left: reader.read(rs, left, idle), Deadline(timeout))
    else:
        rs.stacks.wait(n, asked, timeout)
    return rs.stacks.take(n, asked)


def _unanswered(rs, n: int, asked: List[int], dead) -> List[int]:
    """The ranks among ``asked`` that neither answered request ``n`` nor were lost."""
    answered = set(rs.stacks.answered(n, asked))
    return [r for r in asked if r not in answered and r not in dead]


class StallWatch:
    """A background job's stall detector, ticked by the job's thread (which reads the ranks'
    channels). The job is *stalled* when, for ``stall`` seconds, nothing was logged or printed and
    no rank completed a collective: it then asks the ranks for their stacks (whose recorded
    collectives tell whether any completed one) and keeps them on the call (``call.stalled``),
    which the job's status, repr and live view show. A stall kills nothing; progress clears it."""

    def __init__(self, call, rs, stall: float):
        self.call, self.rs, self.stall = call, rs, stall
        self._seen = self._activity()
        self._since = time.monotonic()  # the last progress seen
        self._asked: Optional[Tuple[int, List[int], float]] = None
        self._done: Optional[Dict[int, int]] = None  # each rank's collectives, at the last look
        self._progressed = self._since  # when progress was last seen

    def _activity(self) -> Tuple[int, int]:
        # (The job's thread.) Counts, never an iteration of ``call.output``: the relay thread
        # adds a rank's first line to that dict meanwhile, and a RuntimeError from here ended
        # the job's wait and tore the group down. The count also goes on past the lines kept.
        call = self.call
        return len(call.metrics), call.lines

    def tick(self) -> None:
        """Look for progress; ask for stacks when there was none for ``stall`` s. A job paused at
        a breakpoint is not stalled: the watch starts again when it goes on."""
        now = time.monotonic()
        pauses = self.call.pauses
        if pauses is not None and pauses.where():
            if self._asked is not None:  # answers nobody will read
                self.rs.stacks.take(*self._asked[:2])
                self._asked = None
            self._progress(now)
            return
        activity = self._activity()
        if activity != self._seen:
            self._seen = activity
            self._progress(now)
        if self._asked is not None:
            n, asked, when = self._asked
            if len(self.rs.stacks.answered(n, asked)) == len(asked) or now - when > 5.0:
                self._asked = None
                self._look(self.rs.stacks.take(n, asked), now)
        elif now - self._since >= self.stall:
            n, asked = ask(self.rs, sorted(self.call.pending))
            self._asked = (n, asked, now)

    def _look(self, got: Dict[int, Dict[str, Any]], now: float) -> None:
        # progress of a rank's collectives: the newest one's number, plus how many returned
        done = {r: sum(1 for e in body.get("collectives", ()) if e[6] is not None) +
                max((e[0] for e in body.get("collectives", ())), default=0)
                for r, body in got.items()}
        if self._done is None:  # a baseline: look again in half the stall time, to see if they move
            self._done = done
            self._since = now - self.stall / 2
            return
        moved = any(done.get(r) != self._done.get(r) for r in done)
        self._done = done
        if moved:
            self._progress(now)
            return
        call = self.call
        call.stalled = Stacks({r: got.get(r) for r in sorted(call.pending)}, len(self.rs.ranks))
        if call.stalled_since is None:
            call.stalled_since = time.time() - (now - self._progressed)
        self._since = now - self.stall / 2  # look again in half the stall time

    def _progress(self, now: float) -> None:
        self._since = self._progressed = now
        self.call.stalled = self.call.stalled_since = None


#: how long a timed-out call waits for its ranks' stacks before it interrupts them
AT_TIMEOUT_S = 2.0


def at_timeout(call, rs, waiting: List[int], world_size: int) -> Optional["Stacks"]:
    """The stacks of a timed-out call's ``waiting`` ranks, taken before they are interrupted
    (the caller's thread reads the channels: :meth:`Call.poll <nbdist.runtime.calls.Call.poll>`
    posts each answer). ``None`` if no rank answered."""
    n, asked = ask(rs, waiting)
    try:
        poll_until(lambda: not _unanswered(rs, n, asked, call.dead),
                   lambda left: call.poll(rs, left), Deadline(AT_TIMEOUT_S))
    except KeyboardInterrupt:
        pass  # interrupted while waiting: report what came
    got = rs.stacks.take(n, asked)
    return Stacks({r: got.get(r) for r in waiting}, world_size) if got else None


class Stacks:
    """What ``Group.stacks()`` returns: each rank's threads and frames (``by_rank``), shown with
    ranks whose stacks are the same folded together. ``str()`` is the folded view with source
    lines; ``summary()`` one line per set of ranks."""

    def __init__(self, by_rank: Dict[int, Optional[Dict[str, Any]]], world_size: int):
        #: rank -> ``{"threads": [...], "time", "pid"}``, or ``None`` where no answer came
        self.by_rank = dict(sorted(by_rank.items()))
        self.world_size = world_size

    def frames(self, rank: int) -> List[tuple]:
        """The main thread's frames of ``rank`` (outermost first): ``(file, line, function,
        source)``; ``[]`` while it waits for a request."""
        body = self.by_rank.get(rank)
        return next((t["frames"] for t in body["threads"] if t["main"]), []) if body else []

    def folded(self) -> List[Tuple[List[int], Optional[Dict[str, Any]]]]:
        """``[(ranks, body)]``: ranks whose threads show the same frames, together."""
        groups: Dict[Any, List[int]] = {}
        bodies: Dict[Any, Optional[Dict[str, Any]]] = {}
        for r, body in self.by_rank.items():
            key = None if body is None else tuple(
                (t["name"] if not t["main"] else "", tuple(f[:3] for f in t["frames"]))
                for t in body["threads"])
            groups.setdefault(key, []).append(r)
            bodies.setdefault(key, body)
        return [(ranks, bodies[key]) for key, ranks in groups.items()]

    def collectives(self) -> List[str]:
        """What the ranks' recorded collectives say (:func:`nbdist.runtime.recorder.analyse`):
        mismatched collectives and ranks that never reached one, in sentences; ``[]`` when no
        collective is running."""
        records = {r: (b or {}).get("collectives") if b else None for r, b in self.by_rank.items()}
        places = {r: _short(self.frames(r)[-1]) for r in self.by_rank if self.frames(r)}
        return recorder.analyse(records, places)

    def summary(self) -> str:
        """The collectives' analysis (if a collective runs), then one line per set of ranks:
        ``ranks 0, 1: Cell In[3]:2 <module> -> ... sleep``."""
        lines = self.collectives()
        for ranks, body in self.folded():
            if body is None:
                lines.append(f"{ranks_phrase(ranks)}: no answer (exited, or not reachable)")
                continue
            frames = next((t["frames"] for t in body["threads"] if t["main"]), [])
            path = " -> ".join(_short(f) for f in frames) or "idle (waiting for a request)"
            lines.append(f"{ranks_phrase(ranks)}: {path}")
        return "\n".join(lines)

    def __str__(self) -> str:
        out = self.collectives()
        for ranks, body in self.folded():
            out.append(f"--- {ranks_phrase(ranks)} ---")
            if body is None:
                out.append("  no answer (exited, or not reachable)")
                continue
            for t in body["threads"]:
                if body.get("all") or not t["main"]:
                    out.append(f"  thread {t['name']}{' (main)' if t['main'] else ''}:")
                if not t["frames"]:
                    out.append("    idle (waiting for a request)")
                for f in t["frames"]:
                    out.append(f"    {_place(f)}, in {f[2]}")
                    if f[3]:
                        out.append(f"      {f[3]}")
        return "\n".join(out)

    def __repr__(self) -> str:
        return f"<Stacks of {ranks_phrase(self.by_rank)}>\n{self}"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the folded stacks
        p.text(str(self))


def _place(frame: tuple) -> str:
    return cells.place(frame[0], frame[1]) if cells.is_cell(frame[0]) else \
        f"{_shorten(frame[0])}:{frame[1]}"


def _shorten(path: str) -> str:
    """Paths inside site-packages from the package on (``torch/distributed/...``)."""
    marker = os.sep + "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def _short(frame: tuple) -> str:
    return cells.short(frame[0], frame[1], frame[2])
