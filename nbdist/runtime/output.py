"""Where a group's rank output goes: kept whole on the call (``group.last_output``, ``job.output``),
and shown -- with repeats folded (:mod:`nbdist.wire.repeats`), as written, or handed to the user's
``output=`` sink.

Threads: :meth:`RankOutput.line` and :meth:`RankOutput.tick` run on the relay thread, in the context
of the call that was running (so the lines land in its cell); :meth:`RankOutput.begin` and
:meth:`RankOutput.finish` run on the thread of the call (the caller's, or a job's). One lock keeps
the folder consistent between them.

Ranks of a group that spans several nodes (attached: torchrun's ``GROUP_RANK``, srun's
``SLURM_NODEID``) are labelled with their node where one rank is named: ``[rank 3, node 1]``.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Dict, List, Optional

from ..wire.relay import OutputRelay, Sink, default_sink
from ..wire.repeats import RepeatFolder, Shown
from .calls import Call

HEADER = ("nbdist: repeated lines were shown once; here is who printed them and how often (every "
          "line: %%dist --all-output, or group.last_output):\n")


class RankOutput:
    """A group's output router: one per group, one folder per call.

    ``dedupe``: fold repeated lines; ``user_sink()``: the group's ``output=`` sink (or ``None``:
    nbdist's own display), read at every line since the group's attribute may change;
    ``nodes()``: rank -> node label, for groups on several nodes (``{}``: no node labels).
    """

    def __init__(self, dedupe: bool = True,
                 user_sink: Callable[[], Optional[Sink]] = lambda: None,
                 nodes: Callable[[], Dict[int, str]] = dict) -> None:
        self._user_sink, self._nodes = user_sink, nodes
        self._lock = threading.Lock()
        self._call: Optional[Call] = None
        self._folder: Optional[RepeatFolder] = None
        self.dedupe = dedupe

    @property
    def dedupe(self) -> bool:
        """Whether the calls that start from now on fold repeated lines."""
        return self._dedupe

    @dedupe.setter
    def dedupe(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"dedupe_output must be True or False, got {value!r}")
        self._dedupe = value

    def begin(self, call: Call) -> None:
        """``call`` starts: its output is kept on it, and folded if :attr:`dedupe` is on and the
        output goes to nbdist's own display, not to a sink of the user's."""
        if self._folder is not None and self._call is not None:
            self.finish(self._call, None)  # the last call ended without finishing (an error)
        with self._lock:
            self._call = call
            fold = self._dedupe and self._user_sink() is None
            self._folder = RepeatFolder() if fold else None

    def line(self, rank: int, stream: str, text: str) -> None:
        """What ``rank`` wrote (whole lines): kept on the call, then shown, or handed unfolded to
        the user's sink."""
        call = self._call
        if call is not None:
            call.add_output(rank, text)
        sink = self._user_sink()
        if sink is not None:
            sink(rank, stream, text)
            return
        with self._lock:
            if self._folder is None:
                node = self._node_map().get(rank)
                if node is None:
                    default_sink(rank, stream, text)
                else:
                    _write([Shown((rank,), stream, text, f"rank {rank}, node {node}")])
                return
            _write(self._labelled(self._folder.feed(rank, stream, text, time.monotonic())))

    def tick(self, now: float) -> Optional[float]:
        """Show the held lines that are due; seconds until the next one is (``None``: none held)."""
        with self._lock:
            if self._folder is None:
                return None
            _write(self._labelled(self._folder.due(now)))
            return self._folder.next_due(now)

    def finish(self, call: Call, relay: Optional[OutputRelay]) -> None:
        """``call`` ended: relay what has arrived, show what is still held, then the summary of
        what was folded. Lines that arrive later are shown as they come."""
        if relay is not None:
            relay.drain(flush_partial=True)
        with self._lock:
            if self._call is not call or self._folder is None:
                return
            folder, self._folder = self._folder, None
            held, summary = folder.finish()
            _write(self._labelled(held))
            for stream in ("stdout", "stderr"):
                mine = [item for item in summary if item.stream == stream]
                if mine:
                    _stream(stream).write(HEADER)
                    _write(mine)


    def _node_map(self) -> Dict[int, str]:
        """rank -> node, when the group's ranks sit on more than one node (else ``{}``)."""
        nodes = self._nodes()
        return nodes if len(set(nodes.values())) > 1 else {}

    def _labelled(self, shown: List[Shown]) -> List[Shown]:
        """A line shown for one rank names its node too (groups on several nodes)."""
        nodes = self._node_map()
        if nodes:
            for item in shown:
                if len(item.ranks) == 1 and item.ranks[0] in nodes:
                    item.label = f"{item.label}, node {nodes[item.ranks[0]]}"
        return shown


def rank_nodes(ranks) -> Dict[int, str]:
    """rank -> node of the ranks a launcher started on named nodes (attached groups; else ``{}``)."""
    return {r.rank: str(r.process.node) for r in ranks
            if str(getattr(r.process, "node", "?")) not in ("", "?")}


def _stream(name: str):
    return sys.stderr if name == "stderr" else sys.stdout


def _write(shown: List[Shown]) -> None:
    for item in shown:
        out = _stream(item.stream)
        out.write(item.render())
        out.flush()
