"""What a memory table says besides its cells: the notes under it (each fact once, after the
strategies and ranks it holds for; sizes in the table's unit; a pipeline's stages on one line)
and its rows (ranks with equal figures folded into one). Used by :mod:`.report`; it works on
records as plain objects, so it imports nothing of the package."""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _notes(records: Sequence[Any]) -> List[str]:
    """Each fact once: a note that several ranks or strategies share is written once, after the
    strategies (and ranks, where not all of a strategy's) it holds for."""
    all_ranks: Dict[str, List[int]] = {}
    where: Dict[str, Dict[str, List[int]]] = {}
    for r in records:
        all_ranks.setdefault(r.strategy, []).append(r.rank)
        for note in dict.fromkeys(r.notes):
            where.setdefault(note, {}).setdefault(r.strategy, []).append(r.rank)
    out = []
    for note, strategies in where.items():
        labels = [name if sorted(ranks) == sorted(all_ranks[name]) else
                  f"{name} {_ranks(sorted(ranks))}" for name, ranks in strategies.items()]
        out.append(f"{', '.join(labels)}: {note}")
    return out


def _rss_note(records: Sequence[Any]) -> Optional[str]:
    """rss is the whole process (torch alone is hundreds of MiB): a note, not a column."""
    rss = [r.rss for r in records if r.rss is not None]
    if not rss:
        return None
    base = [r.rss_base for r in records if r.rss_base is not None]
    before = f", of which {_span(base)} before the model was built" if base else ""
    return (f"rss (process memory, not in the table): {_span(rss)} per rank{before}: torch and "
            "Python themselves, a coarse OOM guard; to_dicts() has it per rank")


def _span(values: List[int]) -> str:
    """``"263 to 287 MiB"``: whole numbers in the binary unit of the smallest (RSS is coarse)."""
    unit, scale = next((u, float(b)) for u, b in (("GiB", 1 << 30), ("MiB", 1 << 20),
                                                 ("KiB", 1 << 10), ("B", 1))
                       if min(values) >= b)
    low, high = (f"{v / scale:.0f}" for v in (min(values), max(values)))
    return f"{low} {unit}" if low == high else f"{low} to {high} {unit}"


_SIZE = re.compile(r"\b(\d+(?:\.\d+)?) (KiB|MiB|GiB)\b")
_BINARY = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _in_unit(note: str, unit: str) -> str:
    """``note`` with each size it gives in KiB, MiB or GiB written in the table's ``unit``
    (``1.027 MiB`` -> ``1052 KiB`` under a KiB table), to 4 significant digits as
    :func:`format_bytes` writes them; a size under 1 of ``unit`` and sizes in B stay as written."""
    def convert(m):
        value = float(m.group(1)) * _BINARY[m.group(2)] / _BINARY[unit]
        return m.group(0) if value < 1 or m.group(2) == unit else f"{value:.4g} {unit}"
    return _SIZE.sub(convert, note)


def _fold(rows: List[Dict[str, Any]], keys: Sequence[str]) -> List[Dict[str, Any]]:
    """One row for a strategy's ranks whose every shown value (``keys``) is the same, its rank
    cell ``"0-3"`` (consecutive ranks) or ``"0, 2"``: four equal rows say nothing a fourth time."""
    out: List[Dict[str, Any]] = []
    ranks: List[List[int]] = []
    for row in rows:
        if out and all(out[-1][k] == row[k] for k in keys):
            ranks[-1].append(row["rank"])
        else:
            out.append(dict(row))
            ranks.append([row["rank"]])
    for row, mine in zip(out, ranks):
        if len(mine) > 1:
            whole = mine == list(range(mine[0], mine[0] + len(mine)))
            row["rank"] = f"{mine[0]}-{mine[-1]}" if whole else ", ".join(map(str, mine))
    return out


def _stages_note(records: Sequence[Any]) -> str:
    """One note for a pipeline's ranks: the stage formula (:func:`stage_estimate`'s, without
    the rank's own Ψ_stage) once, then per rank its layers and Ψ_stage: ``rank 0: layers 0-3,
    Ψ_stage=8,320``. Four ranks' full formulas made a table's caption 15 lines long."""
    head = records[0].formula.split("; Ψ_stage=")[0]
    r0 = records[0]
    where = r0.layers.rsplit(" (", 1)  # "stage 0: layers 0-3 of 7", "gpipe, 4 microbatches)"
    schedule = f"; {where[1][:-1]}" if len(where) == 2 else ""
    of = where[0].rsplit(" of ", 1)
    whole = f" in {of[1]} layers" if len(of) == 2 else ""
    ranks = "; ".join(f"rank {r.rank}: {r.layers.rsplit(' (', 1)[0].rsplit(' of ', 1)[0]}, "
                      f"Ψ_stage={r.local_params:,}" for r in records)
    return (f"{head}; Ψ={r0.num_params:,}{whole}, N={r0.world_size}{schedule}) -- {ranks}")
