"""Where a group's rank output goes: kept whole on the call (``group.last_output``, ``job.output``),
and shown -- with repeats folded (:mod:`nbdist.wire.repeats`), as written, or handed to the user's
``output=`` sink.

Threads: :meth:`RankOutput.line` and :meth:`RankOutput.tick` run on the relay thread, in the context
of the call that was running (so the lines land in its cell); :meth:`RankOutput.begin` and
:meth:`RankOutput.finish` run on the thread of the call (the caller's, or a job's). One lock keeps
the folder consistent between them. The user's ``output=`` sink is never called on the relay
thread: its lines queue for a thread of their own (:class:`SinkThread`, ``nbdist-sink``), so a slow
or blocked sink never delays the relay -- which reads the lifelines that tell of a death -- and
:meth:`RankOutput.finish` waits until the call's lines were handed over before its value returns.

Ranks of a group that spans several nodes (attached: torchrun's ``GROUP_RANK``, srun's
``SLURM_NODEID``) are labelled with their node where one rank is named: ``[rank 3, node 1]``.
"""
from __future__ import annotations

import collections
import contextvars
import sys
import threading
import time
from typing import Callable, Deque, Dict, List, Optional

from ..wire import locks
from ..wire.deadline import WAKE_S, Deadline, poll_until
from ..wire.relay import OutputRelay, Sink, default_sink
from ..wire.repeats import RepeatFolder, Shown
from .calls import Call

JOB_DISPLAY: Optional[Callable[[str], Optional[Callable[[str, str], None]]]] = None
"""Where a background job's shown lines go, set by the notebook layer (``%load_ext nbdist`` in a
kernel): ``JOB_DISPLAY(name)``, called as a job starts, on the thread that starts it, returns
``show(stream, text)`` -- a display under the cell that started the job, updated in place, which a
saved or headless-run notebook keeps (a stream message that arrives after its cell ended is
dropped there) -- or ``None``: the caller's sys.stdout / sys.stderr, as for a blocking call."""

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
        self._lock = locks.make("output")
        self._call: Optional[Call] = None
        self._folder: Optional[RepeatFolder] = None
        self._spare: Optional[RepeatFolder] = None  #: an empty folder the next call takes
        self._to_user = SinkThread()
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
            self.finish(self._call, None, wait=False)  # the last call ended without finishing
        with self._lock:
            self._call = call
            fold = self._dedupe and self._user_sink() is None
            self._folder, self._spare = (self._spare or RepeatFolder()) if fold else None, None

    def show_job(self, call: Call, name: str) -> None:
        """``call`` is background job ``name``'s: its shown lines go to :data:`JOB_DISPLAY`'s
        display, if the notebook layer set one and no ``output=`` sink of the user's takes them."""
        if JOB_DISPLAY is not None and self._user_sink() is None:
            call.show = JOB_DISPLAY(name)

    def line(self, rank: int, stream: str, text: str) -> None:
        """What ``rank`` wrote (whole lines): kept on the call, then shown, or handed unfolded to
        the user's sink."""
        call = self._call
        if call is not None:
            call.add_output(rank, text)
        sink = self._user_sink()
        if sink is not None:
            self._to_user.put(sink, rank, stream, text)
            return
        with self._lock:
            if self._folder is None:
                node = self._node_map().get(rank)
                if node is None and (call is None or call.show is None):
                    default_sink(rank, stream, text)
                else:
                    label = f"rank {rank}" if node is None else f"rank {rank}, node {node}"
                    _write([Shown((rank,), stream, text, label)], call)
                return
            _write(self._labelled(self._folder.feed(rank, stream, text, time.monotonic())), call)

    def tick(self, now: float) -> Optional[float]:
        """Show the held lines that are due; seconds until the next one is (``None``: none held)."""
        with self._lock:
            if self._folder is None:
                return None
            _write(self._labelled(self._folder.due(now)), self._call)
            return self._folder.next_due(now)

    def finish(self, call: Call, relay: Optional[OutputRelay], wait: bool = True) -> None:
        """``call`` ended: relay what has arrived, show what is still held, then the summary of
        what was folded. Lines that arrive later are shown as they come. ``wait``: until the
        user's sink got every line so far (not for a death: its report does not wait on a sink)."""
        if relay is not None:
            relay.drain(flush_partial=True)
        if wait:
            self._to_user.wait()
        with self._lock:
            if self._call is not call or self._folder is None:
                return
            folder, self._folder = self._folder, None
            if folder.empty():  # nothing printed: nothing held, nothing folded (most calls)
                self._spare = folder  # the next call's, as it is
                return
            held, summary = folder.finish()
            _write(self._labelled(held), call)
            for stream in ("stdout", "stderr"):
                mine = [item for item in summary if item.stream == stream]
                if mine:
                    _show(call, stream, HEADER)
                    _write(mine, call)


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


class SinkThread:
    """Hands lines to the user's sink on a thread of its own (``nbdist-sink``), in order, each in
    the context it was relayed in (so it lands in its call's cell). The thread ends after
    :attr:`IDLE_S` seconds without a line; the next line starts it again."""

    IDLE_S = 1.0

    def __init__(self) -> None:
        self._cond = threading.Condition(locks.make("sink", reentrant=True))
        self._lines: Deque[tuple] = collections.deque()
        self._queued = self._delivered = 0
        self._thread: Optional[threading.Thread] = None

    def put(self, sink: Sink, rank: int, stream: str, text: str) -> None:
        """Queue a line for ``sink`` (any thread; never waits for the sink)."""
        with self._cond:
            self._lines.append((contextvars.copy_context(), sink, rank, stream, text))
            self._queued += 1
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._deliver, name="nbdist-sink",
                                                daemon=True)
                self._thread.start()

    def wait(self) -> None:
        """Until every line queued so far went to its sink (a sink that blocks: as long)."""
        if self._delivered >= self._queued:  # every line queued so far went (most calls)
            return
        with self._cond:
            if threading.current_thread() is not self._thread:  # a sink making a call: no wait
                target = self._queued
                # (in steps of WAKE_S: a Ctrl-C the OS gave another thread acts)
                poll_until(lambda: self._delivered >= target, self._cond.wait, Deadline(None),
                           cap=WAKE_S)

    def _deliver(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._lines, self.IDLE_S):
                    self._thread = None
                    return
                context, sink, rank, stream, text = self._lines.popleft()
            try:
                context.run(sink, rank, stream, text)
            except Exception as err:  # noqa: BLE001 -- a broken sink must not stop the others
                sys.__stderr__.write(f"nbdist: output sink failed ({err!r}); rank {rank}: "
                                     f"{text}\n")
            finally:
                with self._cond:
                    self._delivered += 1
                    self._cond.notify_all()


def rank_nodes(ranks) -> Dict[int, str]:
    """rank -> node of the ranks a launcher started on named nodes (attached groups; else ``{}``)."""
    return {r.rank: str(r.process.node) for r in ranks
            if str(r.process.node) not in ("", "?")}


def _stream(name: str):
    return sys.stderr if name == "stderr" else sys.stdout


def _write(shown: List[Shown], call: Optional[Call] = None) -> None:
    for item in shown:
        _show(call, item.stream, item.render())


def _show(call: Optional[Call], stream: str, text: str) -> None:
    """``text`` to where ``call``'s lines go: its ``show`` (a job's display), else the stream."""
    show = call.show if call is not None else None
    if show is not None:
        try:
            show(stream, text)
            return
        except Exception as err:  # noqa: BLE001 -- a broken display must not stop the relay
            sys.__stderr__.write(f"nbdist: the job's output display failed ({err!r}); its lines "
                                 "go to the stream instead\n")
            call.show = None
    out = _stream(stream)
    out.write(text)
    out.flush()
