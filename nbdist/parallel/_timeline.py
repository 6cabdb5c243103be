"""Where a pipeline waits: every microbatch's forward and backward, timed on each rank.

The :class:`Recorder` wraps the ``forward_one_chunk`` / ``backward_one_chunk`` methods of each of
the rank's ``PipelineStage`` objects (the schedule calls them once per microbatch). Those methods
hold the stage's compute only: torch posts the sends and waits for the receives around them, so
the time a rank spends waiting for its neighbour (the gloo recv) is the gap between two events --
the idle time. The loss of a microbatch (on the last stage) counts with its forward. Times are
wall-clock (``time.time``), so the ranks of one machine share one clock.

A :class:`Timeline` is plain data (picklable): return it from the ranks and
``Timeline.merge(group.run(...))`` in the notebook for every rank on one chart.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..report.table import Column, TableView

_KINDS = (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
          ("backward_weight_one_chunk", "backward"))


def theory(schedule: str, microbatches: int, ranks: int, stages_per_rank: int = 1
           ) -> Tuple[Optional[float], str]:
    """The schedule's bubble: idle share of a step when every stage's forward and backward take
    the same time and communication takes none: ``(p-1)/(m+p-1)`` for GPipe and 1F1B (Huang et
    al. 2019; Narayanan et al. 2021), ``(p-1)/(v*m+p-1)`` for interleaved 1F1B with ``v`` stages
    per rank (Narayanan et al. 2021, sec. 2.2; assumes ``m`` a multiple of ``p``)."""
    p, m, v = ranks, microbatches, stages_per_rank
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1} (p={p}, m={m})"
    if schedule == "interleaved1f1b":
        return ((p - 1) / (v * m + p - 1),
                f"(p-1)/(v*m+p-1) = {p - 1}/{v * m + p - 1} (p={p}, v={v}, m={m})")
    return None, f"no formula for schedule {schedule!r}"


class Timeline:
    """One measured pipeline step: per rank, per microbatch, forward and backward intervals.

    ``events``: dicts with ``rank``, ``stage``, ``microbatch``, ``kind`` (``"forward"`` or
    ``"backward"``), ``start``, ``end`` (seconds since the epoch). ``spans``: each rank's
    ``(begin, end)`` of the schedule's step. ``schedule``, ``microbatches``, ``ranks`` (p),
    ``num_stages``: the pipeline measured. Show it as a table (text or HTML), :meth:`bubble` for
    the measured idle share against the theory, :meth:`plot` for a Gantt chart.
    """

    def __init__(self, schedule: str, microbatches: int, ranks: int, num_stages: int,
                 events: Iterable[Dict[str, Any]] = (),
                 spans: Optional[Dict[int, Tuple[float, float]]] = None):
        self.schedule, self.microbatches = schedule, microbatches
        self.ranks, self.num_stages = ranks, num_stages
        self.events: List[Dict[str, Any]] = list(events)
        self.spans: Dict[int, Tuple[float, float]] = dict(spans or {})

    @classmethod
    def merge(cls, timelines: Iterable["Timeline"]) -> "Timeline":
        """One timeline of several ranks' (e.g. ``Timeline.merge(g.run(lambda: pipe.timeline(
        x, y)))``); ``None`` entries (ranks that returned nothing) are skipped."""
        parts = [t for t in timelines if t is not None]
        for t in parts:
            if not isinstance(t, Timeline):
                raise TypeError(f"Timeline.merge() takes Timeline objects (what "
                                f"Pipeline.timeline() returns on the ranks), got "
                                f"{type(t).__name__}")
        if not parts:
            raise ValueError("Timeline.merge() needs at least one Timeline")
        first = parts[0]
        out = cls(first.schedule, first.microbatches, first.ranks, first.num_stages)
        for t in parts:
            if (t.schedule, t.microbatches, t.num_stages) != (out.schedule, out.microbatches,
                                                              out.num_stages):
                raise ValueError(f"cannot merge timelines of different pipelines: "
                                 f"{out.schedule}/m={out.microbatches} and "
                                 f"{t.schedule}/m={t.microbatches}")
            out.events.extend(t.events)
            out.spans.update(t.spans)
        out.events.sort(key=lambda e: (e["start"], e["rank"]))
        return out

    def __len__(self) -> int:
        return len(self.events)

    @property
    def window(self) -> Tuple[float, float]:
        """``(first compute start, last compute end)`` over every rank: the step's makespan."""
        if not self.events:
            raise ValueError("this timeline has no events (was the step run with record=True?)")
        return (min(e["start"] for e in self.events), max(e["end"] for e in self.events))

    def _busy(self) -> Dict[int, float]:
        busy = {r: 0.0 for r in self.spans}
        for e in self.events:
            busy[e["rank"]] = busy.get(e["rank"], 0.0) + e["end"] - e["start"]
        return busy

    def in_flight(self) -> Dict[int, int]:
        """Per rank, the most microbatches whose activations it held at once: forwards run
        whose backward has not finished (all ``m`` for GPipe, at most ``p - rank`` for 1F1B).
        It follows from the order of the rank's events alone, so it does not depend on timing."""
        peak: Dict[int, int] = {r: 0 for r in self.spans}
        held: Dict[int, set] = {}
        for e in sorted(self.events, key=lambda e: (e["rank"], e["end"])):
            mine, key = held.setdefault(e["rank"], set()), (e["stage"], e["microbatch"])
            if e["kind"] == "forward":
                mine.add(key)
            else:
                mine.discard(key)
            peak[e["rank"]] = max(peak.get(e["rank"], 0), len(mine))
        return peak

    def bubble(self) -> Dict[str, Any]:
        """The measured bubble next to the schedule's: ``measured`` (mean over ranks of the idle
        share of the makespan -- waiting for a neighbour's activation or gradient, the gloo
        send/recv included), ``per_rank``, ``theory`` and ``formula`` (see :func:`theory`).

        The theory assumes equal stages and free communication, so the measured figure sits
        above it by the communication and the unequal stages' share."""
        begin, end = self.window
        total = end - begin
        per_rank = {r: 1.0 - b / total for r, b in sorted(self._busy().items())}
        value, formula = theory(self.schedule, self.microbatches, self.ranks,
                                max(1, self.num_stages // max(1, self.ranks)))
        return {"schedule": self.schedule, "microbatches": self.microbatches,
                "ranks": self.ranks, "measured": sum(per_rank.values()) / len(per_rank),
                "theory": value, "formula": formula, "per_rank": per_rank,
                "makespan_s": total}

    def replay(self, times_from: Optional[Iterable["Timeline"]] = None) -> Dict[str, Any]:
        """The schedule's own bubble with this model's stages: every rank runs its events in
        the recorded order, each taking its stage's median time for that kind (forward or
        backward, over the timeline's events), and starts one as soon as its input is there (a
        forward after the previous stage's forward of the microbatch, a backward after the next
        stage's backward, or the last stage's own forward): sends are free, every rank has a
        core and nothing else runs. Returns ``bubble`` (mean idle share), ``makespan_s`` and
        ``per_rank``. What :meth:`bubble` measures above it went to sends, the schedule's own
        work between microbatches, slow outliers and, where ranks share cores, waiting for one.
        Medians keep one preempted microbatch from moving the figure; ``times_from`` (several
        recorded steps of the same pipeline, e.g. this one among them) takes them over all of
        their events, which steadies them further on a busy machine."""
        if not self.events:
            raise ValueError("this timeline has no events (was the step run with record=True?)")
        queues: Dict[int, List[Dict[str, Any]]] = {}
        for e in sorted(self.events, key=lambda e: e["start"]):
            queues.setdefault(e["rank"], []).append(e)
        last = max(e["stage"] for e in self.events)
        times: Dict[Tuple[str, int], List[float]] = {}
        for e in (e for t in (times_from or [self]) for e in t.events):
            times.setdefault((e["kind"], e["stage"]), []).append(e["end"] - e["start"])
        typical = {k: statistics.median(v) for k, v in times.items()}
        done: Dict[Tuple[str, int, int], float] = {}
        clock = {r: 0.0 for r in queues}
        busy = {r: 0.0 for r in queues}
        while any(queues.values()):
            moved = False
            for rank, queue in queues.items():
                while queue:
                    e = queue[0]
                    s, i = e["stage"], e["microbatch"]
                    need = (("forward", s - 1, i) if s > 0 else None) if e["kind"] == "forward" \
                        else ("backward", s + 1, i) if s < last else ("forward", s, i)
                    if need is not None and need not in done:
                        break
                    took = typical.get((e["kind"], s))
                    if took is None:
                        raise ValueError(f"replay(): times_from has no {e['kind']} of stage {s}: "
                                         f"pass recorded steps of the same pipeline")
                    clock[rank] = max(clock[rank], done[need] if need else 0.0) + took
                    busy[rank] += took
                    done.setdefault((e["kind"], s, i), clock[rank])
                    queue.pop(0)
                    moved = True
            if not moved:
                raise ValueError("replay(): the recorded events do not form one whole step "
                                 "(a microbatch's forward or backward is missing on a stage)")
        span = max(clock.values())
        per_rank = {r: 1.0 - b / span for r, b in sorted(busy.items())}
        return {"bubble": sum(per_rank.values()) / len(per_rank), "makespan_s": span,
                "per_rank": per_rank}

    def rows(self) -> List[Dict[str, Any]]:
        """Per rank: ``stages``, mean ``forward_s`` / ``backward_s`` per microbatch, ``busy_s``,
        ``idle_s``, ``idle`` (share of the makespan) and ``in_flight`` (:meth:`in_flight`)."""
        begin, end = self.window
        held = self.in_flight()
        out = []
        for rank, busy in sorted(self._busy().items()):
            mine = [e for e in self.events if e["rank"] == rank]
            fwd = [e["end"] - e["start"] for e in mine if e["kind"] == "forward"]
            bwd = [e["end"] - e["start"] for e in mine if e["kind"] == "backward"]
            out.append({"rank": rank,
                        "stages": ", ".join(str(s) for s in sorted({e["stage"] for e in mine})),
                        "forward_s": sum(fwd) / len(fwd) if fwd else None,
                        "backward_s": sum(bwd) / len(bwd) if bwd else None,
                        "busy_s": busy, "idle_s": (end - begin) - busy,
                        "idle": 1.0 - busy / (end - begin), "in_flight": held.get(rank, 0)})
        return out

    def table(self) -> TableView:
        """Per-rank figures (:meth:`rows`) as a table, the bubble against its theory under it."""
        b = self.bubble()
        cols = [Column("rank", kind="number"), Column("stages", kind="text"),
                Column("forward_s", "forward", "time", group="mb"),
                Column("backward_s", "backward", "time", group="mb"),
                Column("busy_s", "busy", "time", group="step"),
                Column("idle_s", "idle", "time", group="step"),
                Column("idle", "idle share", "fraction", decimals=1),
                Column("in_flight", "peak in flight (microbatches)", "number")]
        theory_text = "not computed" if b["theory"] is None else f"{b['theory']:.1%}"
        notes = [f"{self.schedule}, {self.microbatches} microbatches, {self.ranks} ranks, "
                 f"{self.num_stages} stages; forward/backward: mean per microbatch; peak in "
                 f"flight: most microbatches whose activations the rank held at once",
                 f"bubble: measured {b['measured']:.1%} of a {b['makespan_s'] * 1e3:.2f} ms step "
                 f"(mean idle share over ranks), theory {theory_text}: {b['formula']}"]
        whole = {(e["kind"], e["stage"], e["microbatch"]) for e in self.events}
        if len(whole) == 2 * self.num_stages * self.microbatches:  # every rank's events
            notes.append(f"this order replayed with each stage's median times, free sends and a "
                         f"core per rank (Timeline.replay): bubble {self.replay()['bubble']:.1%}")
        return TableView(self.rows(), cols, notes)

    def __repr__(self) -> str:
        if not self.events:
            return f"<nbdist.parallel.Timeline {self.schedule}: no events>"
        return f"<nbdist.parallel.Timeline>\n{self.table().text()}"

    def _repr_html_(self) -> str:
        return self.table()._repr_html_() if self.events else html_empty(self)

    def plot(self, ax=None, span: Optional[float] = None):
        """A per-rank Gantt chart of the step (matplotlib): forward and backward of each
        microbatch as bars, the gaps are where the rank waits; the title gives the step's
        length; return the Axes. ``span`` (seconds): the length of the time axis, for several
        steps on one scale (the longest ``bubble()["makespan_s"]``)."""
        from ..ui.plots.pipeline import plot_pipeline

        return plot_pipeline(self, ax=ax, span=span)


def html_empty(t: Timeline) -> str:
    """The HTML of a timeline without events."""
    return f"<p>nbdist.parallel.Timeline {t.schedule}: no events</p>"


class Recorder:
    """Times the instrumented stages of one rank while a recorded step runs (off otherwise:
    one attribute test per microbatch)."""

    def __init__(self, rank: int, schedule: str, microbatches: int, ranks: int,
                 num_stages: int):
        self.rank, self.schedule, self.microbatches = rank, schedule, microbatches
        self.ranks, self.num_stages = ranks, num_stages
        self.events: Optional[List[Dict[str, Any]]] = None
        self.timeline: Optional[Timeline] = None
        self._begin = 0.0

    def instrument(self, stage) -> None:
        """Wrap the stage's per-microbatch methods (on the instance; the class is untouched)."""
        for attr, kind in _KINDS:
            fn = getattr(stage, attr, None)
            if fn is not None:
                setattr(stage, attr, self._timed(fn, kind, stage.stage_index))

    def _timed(self, fn, kind: str, stage: int):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if self.events is None:
                return fn(*args, **kwargs)
            chunk = args[0] if args else next(iter(kwargs.values()))
            start = time.time()
            out = fn(*args, **kwargs)
            self.events.append({"rank": self.rank, "stage": stage, "microbatch": int(chunk),
                                "kind": kind, "start": start, "end": time.time()})
            return out
        return run

    def timed_loss(self, loss_fn):
        """``loss_fn``, its time added to the forward just before it (the last stage's)."""
        @functools.wraps(loss_fn)
        def loss(*args, **kwargs):
            out = loss_fn(*args, **kwargs)
            if self.events and self.events[-1]["kind"] == "forward":
                self.events[-1]["end"] = time.time()
            return out
        return loss

    def start(self, record: bool) -> None:
        self.events = [] if record else None
        self._begin = time.time()

    def stop(self) -> None:
        if self.events is not None:
            self.timeline = Timeline(self.schedule, self.microbatches, self.ranks,
                                     self.num_stages, self.events,
                                     {self.rank: (self._begin, time.time())})
        self.events = None
