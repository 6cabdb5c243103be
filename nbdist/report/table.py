"""One renderer for every table nbdist shows: HTML in a notebook, aligned text in a terminal.

A :class:`TableView` lays rows (dicts of raw values: seconds, bytes, GB/s) out under
:class:`Column` s. Each column of a unit *kind* gets one unit, named in its header
(``time (µs)``, ``size (KiB)``, ``params (MiB)``), and every number in it is written in that unit,
with the same number of decimals, right-aligned. The unit is the largest in which each non-zero
number of the column (or of its ``group``: columns that share a unit) is at least 1, so a column
with 4 KiB and 64 MiB reads ``4`` and ``65536`` under ``size (KiB)``; columns of one group also
share their number of decimals, so one quantity reads the same in each (``18.50`` and ``18.52``,
never ``18.5`` next to ``18.52``). Plain numbers (ratios) get one number of decimals per column too.
Notes are kept once each, in order. The rows themselves are not changed: exports keep raw SI
values, with the unit in the field name (``time_s``, ``busbw_GBps``).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .units import GiB, KiB, MiB

KINDS: Dict[str, Tuple[Tuple[str, float], ...]] = {
    "time": (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)),
    "bytes": (("TiB", float(1 << 40)), ("GiB", float(GiB)), ("MiB", float(MiB)),
              ("KiB", float(KiB)), ("B", 1.0)),
    "bytes_si": (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)),
    "rate": (("GB/s", 1.0),),
    "fraction": (("%", 0.01),),
    "number": ((None, 1.0),),
    "text": ((None, 1.0),),
    "auto": ((None, 1.0),),
}
"""Column kinds: the raw value's meaning and the units it may be shown in, largest first.

``time``: seconds; ``bytes``: bytes in binary units (every size nbdist tabulates: messages and
memory alike); ``bytes_si``: bytes in decimal units (for a caller's own decimal figures);
``rate``: GB/s (10**9 B/s), as nccl-tests;
``fraction``: a ratio shown in %; ``number``: a plain number; ``text``: left-aligned;
``auto``: ``number`` if every value is a number, else ``text``."""

_MAX_DECIMALS = 3
_DIGITS = 3  # significant digits of a column's smallest non-zero number, when decimals are chosen


@dataclass(frozen=True)
class Column:
    """A column: the row ``key`` it shows, its header ``name``, the ``kind`` of value (see
    :data:`KINDS`), an optional ``group`` of columns sharing one unit, ``decimals`` (default:
    enough for 3 significant digits of the column's smallest number, none if all are whole),
    ``signed`` (write a ``+`` on positive numbers) and ``unit`` (one of the kind's units: the
    column is shown in it whatever its numbers, e.g. a table's every size in the unit of its
    main columns)."""

    key: str
    name: str = ""
    kind: str = "auto"
    group: Optional[str] = None
    decimals: Optional[int] = None
    signed: bool = False
    unit: Optional[str] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown column kind {self.kind!r} for {self.key!r}; "
                             f"valid kinds: {', '.join(KINDS)}")
        units = [u for u, _ in KINDS[self.kind] if u]
        if self.unit is not None and self.unit not in units:
            raise ValueError(f"column {self.key!r} of kind {self.kind!r} cannot be shown in "
                             f"{self.unit!r}; its units: {', '.join(units) or 'none'}")
        if not self.name:
            object.__setattr__(self, "name", self.key)

    @classmethod
    def for_key(cls, key: str) -> "Column":
        """The column a field name asks for, by the unit in its name: ``time_s`` -> ``time``
        in a time unit, ``busbw_GBps`` -> ``busbw (GB/s)``, ``bytes``/``params_bytes`` ->
        ``size``/``params`` in binary units; anything else as it is (``auto``)."""
        if key == "bytes":
            return cls(key, "size", "bytes")
        for suffix, kind in (("_bytes", "bytes"), ("_s", "time"), ("_GBps", "rate")):
            if key.endswith(suffix) and len(key) > len(suffix):
                return cls(key, key[:-len(suffix)], kind)
        return cls(key)


def unit_of(kind: str, values: Iterable[Any]) -> Optional[str]:
    """The unit a column of ``kind`` with these raw ``values`` gets (:class:`TableView`'s rule:
    the largest in which each non-zero number is at least 1); ``None`` for unitless kinds."""
    view = TableView([{"v": v} for v in values], [Column("v", kind=kind)])
    return view._units([kind])[0][0]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _whole(x: float) -> bool:
    return abs(x - round(x)) <= 1e-9 * max(1.0, abs(x))


class TableView:
    """Rows shown under columns: ``str()`` (and ``repr``) is the aligned text table, a notebook
    shows :meth:`_repr_html_`; ``notes`` are lines under the table (a caption in HTML).

    ``columns`` are :class:`Column` s or field names (read with :meth:`Column.for_key`). The
    rows are kept as given; values a row lacks show as ``-``.
    """

    def __init__(self, rows: Iterable[Mapping[str, Any]],
                 columns: Sequence[Union[Column, str]], notes: Iterable[str] = ()):
        self.rows: List[Mapping[str, Any]] = list(rows)
        self.columns: List[Column] = [c if isinstance(c, Column) else Column.for_key(c)
                                      for c in columns]
        self.notes: List[str] = list(dict.fromkeys(str(n) for n in notes))  # each fact once
        self._laid_out: Optional[Tuple[List[str], List[List[str]], List[bool]]] = None

    # ---- layout -------------------------------------------------------------------------------
    def _kind(self, col: Column) -> str:
        if col.kind != "auto":
            return col.kind
        values = [r.get(col.key) for r in self.rows if r.get(col.key) is not None]
        return "number" if values and all(_is_number(v) for v in values) else "text"

    def _units(self, kinds: List[str]) -> List[Tuple[Optional[str], float]]:
        """The (unit, scale) of each column: one per group, by the group's smallest number."""
        smallest: Dict[str, float] = {}
        for col, kind in zip(self.columns, kinds):
            group = col.group or f"\0{col.key}"
            for row in self.rows:
                v = row.get(col.key)
                if _is_number(v) and v != 0 and math.isfinite(v):
                    smallest[group] = min(smallest.get(group, math.inf), abs(v))
        out = []
        for col, kind in zip(self.columns, kinds):
            low = smallest.get(col.group or f"\0{col.key}")
            scales = KINDS[kind]
            if col.unit is not None:
                out.append(next(u for u in scales if u[0] == col.unit))
            elif low is None:  # nothing but zeros and blanks: the base unit (s, B)
                out.append(next((u for u in scales if u[1] == 1.0), scales[-1]))
            else:
                out.append(next((u for u in scales if low >= u[1] * (1 - 1e-9)), scales[-1]))
        return out

    def _layout(self) -> Tuple[List[str], List[List[str]], List[bool]]:
        if self._laid_out is None:
            kinds = [self._kind(c) for c in self.columns]
            units = self._units(kinds)
            headers = [c.name + (f" ({unit})" if unit else "")
                       for c, (unit, _) in zip(self.columns, units)]
            decimals = self._decimals(kinds, units)
            columns = [self._cells(c, k, s, d)
                       for c, k, (_, s), d in zip(self.columns, kinds, units, decimals)]
            cells = [list(row) for row in zip(*columns)] if columns else [[] for _ in self.rows]
            self._laid_out = headers, cells, [k != "text" for k in kinds]
        return self._laid_out

    def _scaled(self, col: Column, kind: str, scale: float) -> List[float]:
        if kind == "text":
            return []
        return [abs(v) / scale for v in (r.get(col.key) for r in self.rows)
                if _is_number(v) and math.isfinite(v)]

    def _decimals(self, kinds: List[str], units: List[Tuple[Optional[str], float]]) -> List[int]:
        """Each column's decimals: its own if fixed, else one count per group (or column): none
        if every number is whole, else enough for 3 significant digits of the smallest."""
        scaled: Dict[str, List[float]] = {}
        for col, kind, (_, scale) in zip(self.columns, kinds, units):
            if col.decimals is None:
                scaled.setdefault(col.group or f"\0{col.key}", []).extend(
                    self._scaled(col, kind, scale))
        out = []
        for col in self.columns:
            if col.decimals is not None:
                out.append(col.decimals)
                continue
            values = scaled.get(col.group or f"\0{col.key}", [])
            nonzero = [x for x in values if x > 0]
            if all(_whole(x) for x in values) or not nonzero:
                out.append(0)
            else:
                digits = _DIGITS - 1 - math.floor(math.log10(min(nonzero)))
                out.append(max(0, min(_MAX_DECIMALS, digits)))
        return out

    def _cells(self, col: Column, kind: str, scale: float, decimals: int) -> List[str]:
        values = [r.get(col.key) for r in self.rows]
        if kind == "text":
            return ["-" if v is None else str(v) for v in values]
        sign = "+" if col.signed else ""
        out = []
        for v in values:
            if v is None:
                out.append("-")
            elif not _is_number(v) or not math.isfinite(v):
                out.append(str(v))
            else:
                out.append(f"{v / scale:{sign}.{decimals}f}")
        return out

    # ---- forms --------------------------------------------------------------------------------
    def headers(self) -> List[str]:
        """Each column's header: its name and, for a unit kind, the unit, e.g. ``time (µs)``."""
        return list(self._layout()[0])

    def cells(self) -> List[List[str]]:
        """The rows as they are shown: one list of strings per row, in the headers' units."""
        return [list(r) for r in self._layout()[1]]

    def text(self) -> str:
        """The plain-text table: headers, a rule, aligned rows (numbers right), then the notes."""
        headers, cells, numeric = self._layout()
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

        def line(values):
            return "  ".join(v.rjust(w) if num else v.ljust(w)
                             for v, w, num in zip(values, widths, numeric)).rstrip()

        lines = [line(headers)]
        lines.append("-" * len(lines[0]))
        lines += [line(r) for r in cells]
        return "\n".join(lines + self.notes)

    def _repr_html_(self) -> str:
        headers, cells, numeric = self._layout()
        style = ["text-align:right" if num else "text-align:left" for num in numeric]
        head = "".join(f"<th style='{s}'>{html.escape(h)}</th>" for h, s in zip(headers, style))
        body = "".join("<tr>" + "".join(f"<td style='{s}'>{html.escape(v)}</td>"
                                        for v, s in zip(row, style)) + "</tr>" for row in cells)
        caption = ""
        if self.notes:
            caption = ("<caption style='caption-side:bottom;text-align:left'>"
                       + "<br>".join(html.escape(n) for n in self.notes) + "</caption>")
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def _repr_pretty_(self, p, cycle: bool) -> None:
        p.text(self.text())

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()
