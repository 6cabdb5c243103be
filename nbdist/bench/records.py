"""Tidy results: :class:`Table`, a list of dict rows with CSV/JSON/pandas exports, and
:class:`Records`, the benchmark's table, which also formats itself and plots.

Every row of a :class:`Records` has the fields in :data:`FIELDS` (see there for their meaning).
CSV and JSON round-trip: ``Records.from_csv(path)`` gives back what ``to_csv(path)`` wrote.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Union

from ..report.table import Column, TableView

NOISY_SPREAD = 2.0
"""A record is flagged ``noisy`` when its p90 time exceeds this many times its p10 time."""

FIELDS = {
    "op": "the operation (see nbdist.bench.OPS)",
    "bytes": "message size in bytes (nccl-tests' size: the largest buffer of the op)",
    "count": "elements per buffer of that size",
    "dtype": "element type, e.g. 'float32'",
    "world_size": "number of ranks",
    "backend": "torch.distributed backend of the group",
    "device": "'cpu' or 'cuda'",
    "iters": "measured iterations (after warm-up)",
    "warmup": "warm-up iterations, not measured",
    "time_s": "median over iterations of the slowest rank's time, in seconds",
    "mean_s": "slowest rank's mean time per iteration (its block time / iters, nccl-tests' "
              "statistic); spikes included; the bandwidths do not use it",
    "p10_s": "10th percentile of the same",
    "p90_s": "90th percentile of the same",
    "spiked": "share of the iterations slower than NOISY_SPREAD (2) x p10_s (the spikes); from "
              "0.5 the median is one of them",
    "noisy": "True when p90_s > NOISY_SPREAD (2) x p10_s: the iterations disagree; measure "
             "again or with more iters",
    "rank_min_s": "fastest rank's own median time",
    "rank_max_s": "slowest rank's own median time",
    "algbw_GBps": "bytes / time_s (the median), in GB/s (10**9 B/s); nccl-tests' algbw",
    "busbw_GBps": "algbw times nccl-tests' bus factor of the op",
    "status": "'ok', 'unsupported' (the backend raised; see note) or 'wrong' (result check failed)",
    "verified": "the op's result was checked against the expected values (once per size)",
    "note": "why an op is unsupported or wrong; None otherwise",
}
"""The fields of a benchmark record, with their meaning."""

_INT_RE = re.compile(r"^-?\d+$")
_FLOAT_RE = re.compile(r"^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-?(inf|nan)$")
PathOrFile = Union[str, "os.PathLike[str]", io.IOBase]


def _cell(text: str) -> Any:
    """Inverse of how :meth:`Table.to_csv` writes a value."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    if _INT_RE.match(text):
        return int(text)
    if _FLOAT_RE.match(text):
        return float(text)
    return text


def _read(source: PathOrFile) -> str:
    if hasattr(source, "read"):
        return source.read()
    with open(source, encoding="utf-8") as f:
        return f.read()


def _write(text: str, path: Optional[PathOrFile]) -> Optional[str]:
    if path is None:
        return text
    if hasattr(path, "write"):
        path.write(text)
    else:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    return None


class Table(list):
    """A list of dict rows (one per measurement) with exports to pandas, CSV and JSON."""

    def columns(self) -> List[str]:
        """Field names, in the order they first appear in the rows."""
        return list(dict.fromkeys(k for row in self for k in row))

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` (needs pandas; CSV and JSON do not)."""
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError("to_pandas() needs pandas (pip install pandas); to_csv() and "
                              "to_json() work without it.") from err
        return pd.DataFrame(list(self), columns=self.columns())

    def to_csv(self, path: Optional[PathOrFile] = None) -> Optional[str]:
        """Write CSV to ``path`` (a file name or an open text file); return the text if no path."""
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=self.columns(), lineterminator="\n")
        writer.writeheader()
        for row in self:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
        return _write(buf.getvalue(), path)

    def to_json(self, path: Optional[PathOrFile] = None) -> Optional[str]:
        """Write a JSON list of rows to ``path``; return the text if no path."""
        return _write(json.dumps(list(self), indent=1) + "\n", path)

    @classmethod
    def from_csv(cls, source: PathOrFile):
        """Read what :meth:`to_csv` wrote (a file name or an open text file)."""
        reader = csv.DictReader(io.StringIO(_read(source)))
        return cls({k: _cell(v) for k, v in row.items()} for row in reader)

    @classmethod
    def from_json(cls, source: PathOrFile):
        """Read what :meth:`to_json` wrote (a file name or an open text file)."""
        rows = json.loads(_read(source))
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("expected a JSON list of records (objects), as to_json() writes; "
                             f"got {type(rows).__name__}")
        return cls(rows)

    @classmethod
    def concat(cls, tables: Iterable[Iterable[Dict[str, Any]]]):
        """One table with the rows of several (e.g. runs on different backends)."""
        return cls(row for table in tables for row in table)

    def where(self, **match) -> "Table":
        """The rows whose fields equal the given values: ``records.where(op="all_reduce")``."""
        return type(self)(r for r in self if all(r.get(k) == v for k, v in match.items()))

    def __add__(self, other):
        return type(self)(list(self) + list(other))

    def _column(self, key: str) -> Column:
        """How the field ``key`` is shown (by the unit in its name: ``time_s``, ``busbw_GBps``)."""
        return Column.for_key(key)

    def _notes(self) -> List[str]:
        return []

    def _view(self, columns: Optional[List[str]] = None) -> TableView:
        return TableView(self, [self._column(c) for c in columns or self._columns_shown()],
                         self._notes())

    def format(self, columns: Optional[List[str]] = None) -> str:
        """A plain-text table of ``columns`` (default: all): one unit per column, in its header
        (``time (µs)``), numbers right-aligned. The rows keep their raw values."""
        return self._view(columns or self.columns()).text()

    def _repr_html_(self) -> str:
        return self._view()._repr_html_()

    def _columns_shown(self) -> List[str]:
        return self.columns()

    def __str__(self) -> str:
        return self.format(self._columns_shown())

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {len(self)} rows>\n{self}"


class Records(Table):
    """Benchmark results: one row per (op, size, configuration); fields in :data:`FIELDS`.

    A list of dicts with :meth:`to_pandas`, :meth:`to_csv`, :meth:`to_json`, :meth:`plot`, and a
    readable ``str()`` table (an HTML one in a notebook) with one unit per column, in its header:
    ``size (KiB)``, ``median (µs)``, ``busbw (GB/s)``; the exports keep the raw fields of
    :data:`FIELDS`. ``records + other`` and :meth:`concat` join runs for comparisons.
    """

    SHOWN = ["op", "bytes", "world_size", "backend", "time_s", "p10_s", "p90_s", "algbw_GBps",
             "busbw_GBps", "spiked", "noisy", "status"]
    """The columns ``str()`` and the notebook display show (all are in the data)."""

    def _column(self, key: str) -> Column:
        """The field ``key`` as shown; all times share one unit, so they compare at a glance,
        and ``time_s`` is headed by its statistic, the median."""
        col = super()._column(key)
        if col.kind == "time":
            return Column(key, "median" if key == "time_s" else col.name, "time", group="time")
        if key == "spiked":
            return Column(key, "spiked", "fraction", decimals=0)
        return col

    def _view(self, columns: Optional[List[str]] = None) -> TableView:
        shown = columns or self._columns_shown()
        rows = [dict(r, noisy={True: "yes", False: "no"}.get(r.get("noisy"))) for r in self]
        return TableView(rows, [self._column(c) for c in shown], self._notes(shown))

    def _notes(self, shown: Optional[List[str]] = None) -> List[str]:
        """What the time and bandwidth columns are (when shown), then why ops were unsupported
        or wrong (the ``note`` field), once per op and note."""
        shown = shown or self._columns_shown()
        notes = []
        if "time_s" in shown:  # says only what the columns shown are
            iters = sorted({r["iters"] for r in self if r.get("iters")})
            spread = " (p10, p90)" if {"p10_s", "p90_s"} <= set(shown) else ""
            rate = ("; algbw = size / median" if "algbw_GBps" in shown else
                    "; busbw = size / median x the op's bus factor" if "busbw_GBps" in shown
                    else "")
            notes.append(f"median{spread} of {'/'.join(map(str, iters)) or 'the'} "
                         f"iterations, slowest rank{rate}")
        if "spiked" in shown:
            notes.append(f"spiked: the iterations slower than {NOISY_SPREAD:g} x p10; from half "
                         "of them, the median is one of those")
        if "noisy" in shown and any(r.get("noisy") for r in self):
            notes.append(f"noisy: p90 > {NOISY_SPREAD:g} x p10, the iterations disagree (often "
                         f"a rank that waited for a core); measure again or with more iters")
        if "status" in shown:
            notes.append("status: ok (the result was checked), unsupported (the backend "
                         "lacks the op) or wrong (the check failed)")
        return notes + list(dict.fromkeys(f"{r['op']}: {r['note']}" for r in self
                                          if r.get("note") and r.get("op")))

    def _columns_shown(self) -> List[str]:
        return [c for c in self.SHOWN if any(c in r for r in self)] or self.columns()

    def plot(self, kind: str = "both", ax=None, limit: Optional[float] = None,
             limit_label: str = "memcpy"):
        """Draw the records with matplotlib; return the Axes (two for ``kind="both"``).

        ``kind``: ``"both"`` (latency and bus bandwidth side by side), ``"latency"`` or
        ``"busbw"``. ``limit`` (GB/s), e.g. :func:`nbdist.bench.memcpy_bandwidth`, adds a
        right-hand axis in percent of it to the bandwidth plot, and a line at it when it is near
        the curves (see :func:`nbdist.ui.plots.collectives.plot_busbw`). Noisy points are hollow.
        ``ax``: existing Axes to draw into (two for ``"both"``).
        """
        from ..ui.plots import collectives as plots

        if kind == "both":
            return plots.plot_collectives(self, ax=ax, limit=limit, limit_label=limit_label)
        if kind == "latency":
            return plots.plot_latency(self, ax=ax)
        if kind == "busbw":
            return plots.plot_busbw(self, ax=ax, limit=limit, limit_label=limit_label)
        raise ValueError(f"kind must be 'both', 'latency' or 'busbw', got {kind!r}")
