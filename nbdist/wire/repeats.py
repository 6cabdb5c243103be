"""Quiet ranks: a line that several ranks print, or that a rank prints again and again, is shown
once, labelled with the ranks that printed it; a summary at the end of the call says how often.

How it decides, line by line, as the output streams in (no line waits more than ``window``):

* A line nobody printed before (in this call) is held for ``window`` seconds (0.2 s): ranks that
  run in step -- the usual case, collectives keep them together -- print the same line within
  milliseconds of each other, and those copies join it. When the window ends the line is shown
  once, labelled ``[ranks 0-3]`` (or ``[rank 1]`` if only one rank printed it by then).
* A line that was already shown (any rank, any time earlier in the call) is not shown again; it is
  counted. At the end of the call, :meth:`RepeatFolder.finish` lists each such line once, with the
  ranks that printed it and how many times -- so nothing is hidden without a trace.
* A line that differs per rank (``loss 0.6931`` on one rank, ``loss 0.6928`` on the other) is new,
  so it is shown, per rank, in the order that rank printed it: held lines leave in arrival order,
  and a rank's copy joins a held line only if that keeps the rank's own lines on that stream in
  order. (stdout and stderr reach the kernel separately, so their relative order across a rank's
  two streams is not known and not kept: a rank's ``print`` may arrive before the warning it
  wrote just before it.)
* torch's own log lines differ per rank only in their header: ``[rank1]:[W1204 10:11:12.345
  4242 ProcessGroupGloo.cpp:514] ...`` (the rank prefix torch.distributed adds, the date and time,
  the pid). The rank prefix is dropped (the label names the ranks) and the time and pid are left
  out when lines are compared, so such a warning from every rank shows once, with its ranks, and
  one that every step repeats shows once per call (then counted).
* Indented lines continue the block above them (a warning's source line, a traceback's frames):
  such a line is recognised by its whole block, so ``  warnings.warn(`` under two different warnings
  is two different lines. When a block that was being folded turns out to differ from the one seen
  before, its folded head is shown with the line that differs.

The folder is pure: it is given lines and the time, and returns what to show. Threads and output
streams are the caller's (:mod:`nbdist.runtime.output`).
"""
from __future__ import annotations

import collections
import itertools
import re
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, Optional, Tuple

#: torch.distributed's prefix on a rank's log lines
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
#: a glog-style header (torch's C++ and Python logs): level, date, time, and a pid where given
_HEADER = re.compile(r"^(\[?[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+(?: +\d+)? ")

WINDOW = 0.2  #: seconds a new line waits for the same line from the other ranks
MAX_LINES = 20_000  #: distinct lines remembered per call; beyond, new lines show and are forgotten


def rank_label(ranks: Iterable[int]) -> str:
    """``[3]`` -> ``"rank 3"``, ``[0, 1]`` -> ``"ranks 0, 1"``, ``[0, 1, 2, 3, 6]`` ->
    ``"ranks 0-3, 6"``: runs of three or more ranks are written as a range."""
    ranks = sorted(set(ranks))
    parts: List[str] = []
    start = prev = None
    for r in ranks + [None]:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            if prev - start >= 2:
                parts.append(f"{start}-{prev}")
            else:
                parts.extend(str(x) for x in range(start, prev + 1))
        start = prev = r
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(parts)}"


@dataclass
class Shown:
    """Lines to show now: ``text`` (one line, or a block's head and the line that ended it) from
    ``ranks``, on ``stream``, written as ``[label] line``."""

    ranks: Tuple[int, ...]
    stream: str
    text: str
    label: str

    def render(self) -> str:
        """The text as it is written: every line prefixed with ``[label] ``, newline-terminated."""
        return "".join(f"[{self.label}] {line}\n" for line in self.text.split("\n"))


@dataclass
class _Line:  # one distinct line (in its block), and every time a rank printed it
    stream: str
    text: str
    counts: Dict[int, int] = field(default_factory=dict)
    folded: int = 0  # times it was printed but not shown


@dataclass
class _Held:  # a line waiting for its window to end
    seq: int
    key: Optional[int]
    stream: str
    text: str
    ranks: List[int]
    deadline: float


@dataclass
class _Block:  # what one rank's stream is in the middle of: the block's key so far, its lines
    key: Optional[int] = None
    lines: List[str] = field(default_factory=list)
    folded: bool = False  # every line of the block so far was folded (not shown)


class RepeatFolder:
    """Folds one call's output from all ranks: see the module docstring for the rules.

    ``feed`` takes what a rank wrote (whole lines) and returns what to show now; ``due`` returns
    the held lines whose window has ended; ``finish`` returns everything still held and the summary
    of what was folded, and starts over. Times are ``time.monotonic()`` seconds, given by the
    caller. Not thread-safe: one caller at a time.
    """

    def __init__(self, window: float = WINDOW, max_lines: int = MAX_LINES):
        if window < 0:
            raise ValueError(f"window must be >= 0 seconds, got {window!r}")
        self.window, self.max_lines = window, max_lines
        self._reset()

    def _reset(self) -> None:
        self._keys: Dict[Tuple[Optional[int], str, str], int] = {}
        self._lines: Dict[int, _Line] = {}
        self._held: Deque[_Held] = collections.deque()
        self._held_by_key: Dict[int, _Held] = {}
        self._last_held: Dict[Tuple[int, str], int] = {}  # (rank, stream) -> seq of latest held
        self._blocks: Dict[Tuple[int, str], _Block] = {}
        self._seq = itertools.count()

    def feed(self, rank: int, stream: str, text: str, now: float) -> List[Shown]:
        """Take the lines ``rank`` wrote to ``stream``; return what is due now."""
        for line in text.splitlines():
            self._line(rank, stream, line, now)
        return self.due(now)

    def due(self, now: float) -> List[Shown]:
        """The held lines whose window ended by ``now``, oldest first."""
        shown = []
        while self._held and self._held[0].deadline <= now:
            shown.append(self._release(self._held.popleft()))
        return shown

    def next_due(self, now: float) -> Optional[float]:
        """Seconds until the oldest held line is due (``None``: nothing is held)."""
        return max(0.0, self._held[0].deadline - now) if self._held else None

    def empty(self) -> bool:
        """Nothing was fed since the start (or the last :meth:`finish`)."""
        return not self._blocks  # every line fed makes its (rank, stream) block

    def finish(self) -> Tuple[List[Shown], List[Shown]]:
        """End the call: ``(held lines, summary)``. The summary has one entry per line that was
        folded, labelled with the ranks that printed it and how often; then the folder starts over."""
        held = [self._release(h) for h in self._held]
        summary = [Shown(tuple(sorted(ln.counts)), ln.stream, ln.text, _count_label(ln.counts))
                   for ln in self._lines.values() if ln.folded]
        self._reset()
        return held, summary

    def folded(self) -> int:
        """How many lines were printed but not shown (so far in this call)."""
        return sum(ln.folded for ln in self._lines.values())

    # ---- one line ---------------------------------------------------------------------------
    def _line(self, rank: int, stream: str, line: str, now: float) -> None:
        line = _RANK_PREFIX.sub("", line, count=1)
        block = self._blocks.setdefault((rank, stream), _Block())
        if line[:1] in (" ", "\t") and block.lines:  # continues the block above
            parent = block.key
            block.lines.append(line)
        else:
            parent = None
            block.lines, block.folded = [line], False
        key = self._key(parent, stream, line)
        block.key = key
        if key is None:  # beyond max_lines: show it, remember nothing
            self._hold(None, rank, stream, line, now)
            block.folded = False
            return
        entry = self._lines[key]
        first = not entry.counts
        entry.counts[rank] = entry.counts.get(rank, 0) + 1
        held = self._held_by_key.get(key)
        other = held is not None and rank not in held.ranks  # another rank's copy is held
        if other and self._join(held, rank):  # the same line from another rank, in the window
            block.folded = False
        elif first or other:  # new; or held, but joining it would show this rank out of order
            # if the block's head was folded, show the head with this line (its context)
            text = "\n".join(block.lines) if block.folded else line
            self._hold(key, rank, stream, text, now)
            block.folded = False
        else:
            entry.folded += 1  # shown (or held) already: count it
            block.folded = block.folded or len(block.lines) == 1

    def _key(self, parent: Optional[int], stream: str, line: str) -> Optional[int]:
        ident = (parent, stream, _HEADER.sub(r"\1 ", line, count=1))  # time and pid left out
        key = self._keys.get(ident)
        if key is None:
            if len(self._keys) >= self.max_lines:
                return None
            key = self._keys[ident] = len(self._keys)
            self._lines[key] = _Line(stream, line)
        return key

    def _hold(self, key: Optional[int], rank: int, stream: str, text: str, now: float) -> None:
        held = _Held(next(self._seq), key, stream, text, [rank], now + self.window)
        self._held.append(held)
        self._last_held[rank, stream] = held.seq
        if key is not None:
            self._held_by_key[key] = held

    def _join(self, held: _Held, rank: int) -> bool:
        """Add ``rank`` to a held line if every rank's lines on its stream stay in order: the line
        is after ``rank``'s held lines there, or it is the latest of its ranks' and moves after
        them."""
        stream = held.stream
        if held.seq < self._last_held.get((rank, stream), -1):
            if any(self._last_held[r, stream] != held.seq for r in held.ranks):
                return False  # its ranks printed more since: it cannot move; shown separately
            self._held.remove(held)
            held.seq = next(self._seq)
            self._held.append(held)
            for r in held.ranks:
                self._last_held[r, stream] = held.seq
        held.ranks.append(rank)
        self._last_held[rank, stream] = held.seq
        return True

    def _release(self, held: _Held) -> Shown:
        if held.key is not None and self._held_by_key.get(held.key) is held:
            del self._held_by_key[held.key]
        ranks = tuple(sorted(held.ranks))
        return Shown(ranks, held.stream, held.text, rank_label(ranks))


def _count_label(counts: Dict[int, int]) -> str:
    """``{0: 20, 1: 20}`` -> ``"ranks 0, 1: 20 times each"``; ``{0: 3}`` -> ``"rank 0: 3 times"``;
    ``{0: 20, 1: 19}`` -> ``"ranks 0, 1: 39 times"``."""
    label, values = rank_label(counts), set(counts.values())
    total = sum(counts.values())
    if len(counts) > 1 and len(values) == 1:
        return f"{label}: {total // len(counts)} times each"
    return f"{label}: {total} time{'s' if total != 1 else ''}"
