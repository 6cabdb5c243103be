"""The scalars ranks logged with ``nbdist.log`` (:mod:`nbdist.runtime.ranklog`), as the caller
keeps them: a :class:`Metrics` table per call (``job.metrics`` for a background job)."""
from __future__ import annotations

import csv
import io
import json
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..report.table import Column, TableView, unit_of
from ..report.units import bare_name, format_time, percentile, seconds_per_unit
from ..wire import locks

FIELDS = ("rank", "step", "name", "value", "time_s")
"""The columns of :class:`Metrics`: rank, step (``None`` if not given), scalar name, value, and
the rank's wall-clock time of the log call (seconds since the epoch)."""

MAX_ROWS = 200_000
"""Rows a :class:`Metrics` keeps by default (about 30 MB). Past it, the older half is thinned --
every other row of each (rank, scalar) series dropped -- so recent steps stay whole and older ones
grow sparser; ``dropped`` counts what went and the repr and the live view say so. Set
``job.metrics.max_rows = None`` to keep everything."""

# ---- in the caller -----------------------------------------------------------------------------
class Metrics:
    """The scalars the ranks logged during a call: rows of :data:`FIELDS`, in arrival order.

    ``len(m)``, iteration over dict rows, :meth:`last`, :meth:`series`, exports
    (:meth:`to_pandas`, :meth:`to_csv`, :meth:`to_json`) and :meth:`plot`. Rows arrive on another
    thread while a job runs; every method works on a consistent copy.
    """

    def __init__(self, rows: Optional[List[Tuple]] = None, max_rows: Optional[int] = MAX_ROWS):
        self._rows: List[Tuple] = list(rows or [])
        self._lock = locks.make("metrics")
        self.max_rows = max_rows  #: thin the older rows past this many (``None``: keep all)
        self.dropped = 0  #: rows dropped by thinning so far

    def add(self, batch: List[Tuple]) -> None:
        """Append rows that arrived from a rank (thinning the older ones past ``max_rows``)."""
        with self._lock:
            self._rows.extend(tuple(row) for row in batch)
            if self.max_rows is not None and len(self._rows) > self.max_rows:
                self._thin()

    def _thin(self) -> None:
        """Drop every other row of each (rank, name) series in the older half of the rows."""
        half = len(self._rows) // 2
        seen: Dict[Tuple[int, str], int] = {}
        kept = []
        for row in self._rows[:half]:
            key = (row[0], row[2])
            n = seen[key] = seen.get(key, -1) + 1
            if n % 2 == 0:
                kept.append(row)
        self.dropped += half - len(kept)
        self._rows[:half] = kept

    def rows(self) -> List[Tuple]:
        """A copy of the rows, as tuples in :data:`FIELDS` order."""
        with self._lock:
            return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return iter([dict(zip(FIELDS, row)) for row in self.rows()])

    def names(self) -> List[str]:
        """The scalar names logged, in first-seen order."""
        return list(dict.fromkeys(row[2] for row in self.rows()))

    def last(self) -> Dict[int, Dict[str, Tuple[Optional[int], Any]]]:
        """``{rank: {name: (step, value)}}`` of the latest row of each name on each rank."""
        out: Dict[int, Dict[str, Tuple[Optional[int], Any]]] = {}
        for rank, step, name, value, _ in self.rows():
            out.setdefault(rank, {})[name] = (step, value)
        return out

    def last_step(self) -> Dict[int, Optional[int]]:
        """The latest step each rank logged (``None`` where it logged no step)."""
        out: Dict[int, Optional[int]] = {}
        for rank, step, *_ in self.rows():
            if step is not None or rank not in out:
                out[rank] = step
        return out

    def series(self, name: str, rank: int) -> Tuple[List[Any], List[Any]]:
        """``(steps, values)`` of scalar ``name`` on ``rank`` (steps: log order where none)."""
        xs, ys = [], []
        for i, (r, step, n, value, _) in enumerate(self.rows()):
            if r == rank and n == name:
                xs.append(step if step is not None else len(xs))
                ys.append(value)
        return xs, ys

    def split(self, window: int = 20) -> Dict[int, Tuple[float, float]]:
        """``{rank: (compute_s, comm_s)}`` from what ``nbdist.step`` logged (empty when nothing
        was): each rank's median ``step_s`` over its last ``window`` steps (what
        :meth:`summary` shows as its step), split in the proportion of the medians of its
        compute and communication. The two add up to the median step; the medians of the parts
        alone would not (a median of sums is not the sum of medians)."""
        parts: Dict[Tuple[int, str], List[float]] = {}
        for rank, _, name, value, _ in self.rows():
            if name in ("compute_s", "comm_s", "step_s"):
                parts.setdefault((rank, name), []).append(value)
        out = {}
        for r in sorted({r for r, n in parts if n != "step_s"}):
            compute, comm = (percentile(parts.get((r, n), [0.0])[-window:], 50)
                             for n in ("compute_s", "comm_s"))
            step = percentile(parts[(r, "step_s")][-window:], 50) if (r, "step_s") in parts \
                else compute + comm
            share = compute / (compute + comm) if compute + comm > 0 else 1.0
            out[r] = (step * share, step * (1.0 - share))
        return out

    def stragglers(self, window: int = 20, factor: float = 1.25) -> Dict[int, float]:
        """Ranks whose median ``compute_s`` over their last ``window`` steps is at least
        ``factor`` times the median over the ranks: ``{rank: ratio}`` (from ``nbdist.step``)."""
        per_rank: Dict[int, List[float]] = {}
        for rank, _, name, value, _ in self.rows():
            if name == "compute_s":
                per_rank.setdefault(rank, []).append(value)
        if len(per_rank) < 2:
            return {}
        recent = {r: percentile(v[-window:], 50) for r, v in per_rank.items()}
        middle = percentile(list(recent.values()), 50)
        if middle <= 0:
            return {}
        return {r: m / middle for r, m in sorted(recent.items()) if m >= factor * middle}

    def summary(self, window: int = 20) -> TableView:
        """A table, a row per rank: its last step, then the median of each scalar over its last
        ``window`` values, times in one unit per column (named in the header: ``data (ms)``).
        The rows keep raw values, times in seconds under ``NAME_s`` (``data_ms`` -> ``data_s``)."""
        series: Dict[Tuple[int, str], List[Any]] = {}
        for rank, _, name, value, _ in self.rows():
            series.setdefault((rank, name), []).append(value)
        steps, names, columns = self.last_step(), self.names(), [Column("rank", "rank", "text"),
                                                                 Column("step", "last step")]
        rows = [{"rank": r, "step": s} for r, s in sorted(steps.items())]
        for name in names:
            scale = seconds_per_unit(name)
            key = name if scale is None else name[:name.rindex("_")] + "_s"
            columns.append(Column(key, name if scale is None else key[:-2],
                                  "auto" if scale is None else "time"))
            for row in rows:
                values = [v for v in series.get((row["rank"], name), [])[-window:]
                          if isinstance(v, (int, float)) and not isinstance(v, bool)]
                if values:
                    row[key] = percentile(values, 50) * (scale or 1)
        # every time in one unit, the step's: "comm (µs)" next to "step (ms)" reads as a mismatch
        times = [row[c.key] for row in rows for c in columns if c.kind == "time" and c.key in row]
        unit = unit_of("time", [max(times)]) if times else None
        columns = [replace(c, unit=unit) if c.kind == "time" else c for c in columns]
        return TableView(rows, columns, [f"median of each rank's last {window} values; times "
                                         f"in one unit"])

    def to_pandas(self):
        """A ``pandas.DataFrame`` with the columns of :data:`FIELDS`."""
        import pandas as pd

        return pd.DataFrame(self.rows(), columns=list(FIELDS))

    def to_csv(self, path: Optional[str] = None) -> Optional[str]:
        """CSV with a header row; returns the text when ``path`` is ``None``."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(FIELDS)
        writer.writerows(["" if v is None else v for v in row] for row in self.rows())
        return _write(buf.getvalue(), path)

    def to_json(self, path: Optional[str] = None) -> Optional[str]:
        """A JSON list of row objects; returns the text when ``path`` is ``None``."""
        return _write(json.dumps(list(self), indent=1), path)

    def plot(self, names=None, ax=None):
        """Per-rank curves of each logged scalar against step (needs matplotlib)."""
        from ..ui.plots.metrics import plot_metrics

        return plot_metrics(self, names=names, ax=ax)

    def __repr__(self) -> str:
        return self._summary()

    def _summary(self) -> str:
        last = self.last()
        if not last:
            return "<nbdist Metrics: nothing logged yet>"
        thinned = f" (older rows thinned: {self.dropped} dropped)" if self.dropped else ""
        lines = [f"<nbdist Metrics: {len(self)} rows, {len(last)} ranks{thinned}>"]
        for rank in sorted(last):
            parts = [f"{bare_name(name)}={format_value(name, value)}"
                     for name, (_, value) in last[rank].items()]
            step = self.last_step().get(rank)
            lines.append(f"  rank {rank}" + (f" step {step}" if step is not None else "") + ": "
                         + ", ".join(parts))
        return "\n".join(lines)


def format_value(name: str, value: Any) -> str:
    """A logged value as the repr shows it: a time in its unit (``12.9 ms``), a float to 4
    significant digits."""
    scale = seconds_per_unit(name)
    if scale is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format_time(value * scale)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _write(text: str, path: Optional[str]) -> Optional[str]:
    if path is None:
        return text
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return None
