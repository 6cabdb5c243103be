"""Units and tables for people: sizes, times and rates formatted with their unit, parsed back.

Binary units for every size in a table (KiB, MiB: message sizes and memory alike, see
:mod:`.table`); decimal units for bandwidth (GB/s, as nccl-tests) and for figures quoted against
the ZeRO paper (:func:`human_bytes`, :func:`unit_for`: GB).
"""
from __future__ import annotations

import argparse
import re
from typing import Iterable, List, Optional, Sequence, Tuple, Union

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": GiB, "GB": GiB, "GIB": GiB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*$")

def parse_size(text: Union[str, int]) -> int:
    """One size in bytes: ``4096``, ``"4K"``, ``"64MiB"``, ``"1.5M"`` (units are powers of 1024)."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise TypeError(f"a size is an int of bytes or a str such as '4K', got "
                        f"{type(text).__name__} ({text!r})")
    if isinstance(text, int):
        value = text
    elif text.strip().startswith("-"):
        raise ValueError(f"a size must be a positive number of bytes, got {text!r}; e.g. 4K or "
                         "64MiB")
    else:
        match = _SIZE_RE.match(text)
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"cannot read the size {text!r}: use a number with an optional unit "
                             "B, K, M or G (powers of 1024), e.g. 4K or 64MiB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"sizes must be at least 1 byte, got {text!r}")
    return value


def parse_sizes(spec: Union[str, int, Iterable[Union[str, int]]]) -> List[int]:
    """Message sizes in bytes, sorted and without repeats, from a compact spec.

    ``"4K-64M"`` is every power-of-two multiple from 4 KiB to 64 MiB (like nccl-tests
    ``-b 4K -e 64M -f 2``); ``"4K-64M:4"`` steps by 4 instead; ``"1K,64K,1M"`` lists sizes, and the
    forms mix: ``"8,1K-4K"``. An int or a list of ints/strs is accepted as is.
    """
    if isinstance(spec, (str, int)) and not isinstance(spec, bool):
        items = [spec] if isinstance(spec, int) else [p for p in spec.split(",") if p.strip()]
    elif isinstance(spec, Iterable) and not isinstance(spec, (bytes, dict)):
        items = list(spec)
    else:
        raise TypeError(f"sizes must be a str such as '4K-64M', an int or a list of sizes, got "
                        f"{type(spec).__name__}")
    if not items:
        raise ValueError(f"no sizes in {spec!r}; give e.g. '4K-64M' or '1K,1M'")
    out = set()
    for item in items:
        if isinstance(item, str) and "-" in item and not item.strip().startswith("-"):
            out.update(_parse_range(item))
        else:
            out.add(parse_size(item))
    return sorted(out)


def _parse_range(item: str) -> List[int]:
    rng, _, step = item.partition(":")
    lo_text, _, hi_text = rng.partition("-")
    lo, hi = parse_size(lo_text), parse_size(hi_text)
    if lo > hi:
        raise ValueError(f"the size range {item.strip()!r} goes down; put the smaller size first: "
                         f"'{hi_text.strip()}-{lo_text.strip()}'")
    factor = step.strip() or "2"
    if not factor.isdigit() or int(factor) < 2:
        raise ValueError(f"the step in {item.strip()!r} must be a whole number of at least 2 "
                         "(each size is the previous one times the step), e.g. '4K-64M:4'")
    sizes, size = [], lo
    while size <= hi:
        sizes.append(size)
        size *= int(factor)
    return sizes


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolation percentile (numpy's default) of ``values``, ``q`` in [0, 100]."""
    s = sorted(values)
    if not s:
        return None
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def format_bytes(n: Optional[float]) -> str:
    """``4096`` -> ``"4 KiB"``, ``1.5 * 2**20`` -> ``"1.5 MiB"``."""
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


def format_time(seconds: Optional[float]) -> str:
    """``1.2e-5`` -> ``"12 µs"``, ``0.0031`` -> ``"3.1 ms"``."""
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def format_rate(gbps: Optional[float]) -> str:
    """``2.5`` -> ``"2.5 GB/s"``; ``0.012`` -> ``"0.012 GB/s"``: always GB/s, the unit of every
    bandwidth column (nccl-tests'), so a rate in a sentence reads as the table next to it."""
    if gbps is None:
        return "-"
    return f"{gbps:.3g} GB/s"


def unit_for(nbytes: float):
    """``(scale, name)`` of the decimal unit that shows ``nbytes`` best: (1e6, "MB")..."""
    for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return scale, name
    return 1.0, "B"


def binary_unit_for(nbytes: float):
    """``(scale, name)`` of the binary unit that shows ``nbytes`` best, as the tables use:
    (1048576, "MiB")..."""
    for name, scale in (("TiB", float(1 << 40)), ("GiB", float(GiB)), ("MiB", float(MiB)),
                        ("KiB", float(KiB))):
        if nbytes >= scale:
            return scale, name
    return 1.0, "B"


def human_bytes(n: float) -> str:
    """``31406250000`` -> ``"31.4 GB"`` (decimal units, as the ZeRO paper)."""
    scale, unit = unit_for(n)
    return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n:.0f} B"


_DASHED_VALUE = re.compile(r"-\.?\d")  # -4K, -1e3, -.5: never one of nbdist's options


def dashed_values(parser: argparse.ArgumentParser, argv: List[str]) -> List[str]:
    """``--sizes -4K`` -> ``--sizes=-4K``. argparse takes a word that starts with a minus and is
    no plain negative number (``-4K``, ``-1e3``) for an option, so the option before it "expected
    one argument" and its type never sees the value; given as the option's value, the message
    names it (``argument --sizes: ... got '-4K'``). Used by the magics and the command line."""
    takes_value = {flag for action in parser._actions if action.nargs in (None, "?")
                   for flag in action.option_strings}
    out: List[str] = []
    for word in argv:
        if out and out[-1] in takes_value and _DASHED_VALUE.match(word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


TIME_SUFFIXES = (("_ms", 1e-3), ("_us", 1e-6), ("_ns", 1e-9), ("_s", 1.0))
"""A scalar whose name ends in one of these is a time in that unit (``step_s``, ``data_ms``):
tables, reprs and plots show it in the unit that suits its values."""


def _time_suffix(name: str) -> Tuple[str, Optional[float]]:
    """The time suffix of scalar ``name`` and seconds in its unit (``("", None)``: not a time)."""
    return next(((suffix, scale) for suffix, scale in TIME_SUFFIXES
                 if name.endswith(suffix) and len(name) > len(suffix)), ("", None))


def bare_name(name: str) -> str:
    """Scalar ``name`` without the unit suffix of a time (``data_ms`` -> ``data``): what
    tables and reprs call a time they show in another unit than its name's."""
    return name[:len(name) - len(_time_suffix(name)[0])]


def seconds_per_unit(name: str) -> Optional[float]:
    """Seconds in one unit of scalar ``name``, from its suffix (``step_s``: 1, ``data_ms``: 1e-3);
    ``None`` where the name says it is not a time."""
    return _time_suffix(name)[1]
