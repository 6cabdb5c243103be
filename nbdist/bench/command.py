"""``python -m nbdist bench``: a collective sweep from a terminal, printed as a table.

    python -m nbdist bench --world-size 4 --backend gloo --ops all_reduce,all_gather \\
        --sizes 4K-64M --iters 50 --out results.json --plot bench.png
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import List, Optional

from ..report.units import dashed_values
from .sweep import DEFAULT_SIZES, _check_dtype, collectives, memcpy_bandwidth
from .units import OPS, format_rate, parse_ops, parse_sizes

_OUT_KINDS = (".json", ".csv")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nbdist bench", description="Benchmark torch.distributed "
                                "collectives on a fresh nbdist group and print a table.")
    p.add_argument("--world-size", "-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--backend", "-b", default="auto", help="backend (default auto)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--ops", default=None, help=f"comma-separated, default all: {','.join(OPS)}")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"e.g. 4K-64M (powers of two), 4K-64M:4, 1K,1M (default {DEFAULT_SIZES})")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--iters", type=int, default=50, help="measured iterations per point (50)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up iterations per point (10)")
    p.add_argument("--timeout", type=float, default=None, help="seconds allowed per point")
    p.add_argument("--out", default=None, help="write the records to FILE.json or FILE.csv")
    p.add_argument("--plot", default=None, help="draw latency and bus bandwidth to FILE.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def cli(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m nbdist bench``; return the exit code (1 if a result was wrong
    or the group could not start)."""
    from ..errors import NbdistError
    from ..runtime.api import start

    parser = _parser()
    args = parser.parse_args(dashed_values(parser, sys.argv[1:] if argv is None else argv))
    try:
        ops, sizes = parse_ops(args.ops), parse_sizes(args.sizes)
        dtype = _check_dtype(args.dtype)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    if args.out and os.path.splitext(args.out)[1].lower() not in _OUT_KINDS:
        parser.error(f"--out must name a .json or .csv file, got {args.out!r}")
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    try:
        with start(args.world_size, backend=args.backend, device=args.device) as g:
            records = collectives(g, ops, sizes, dtype=dtype, iters=args.iters,
                                  warmup=args.warmup, progress=not args.no_progress,
                                  timeout=args.timeout)
            memcpy = memcpy_bandwidth(g)
    except (NbdistError, ValueError) as err:
        print(f"nbdist bench: {err}", file=sys.stderr)
        return 1
    print(records)
    best = max((r["busbw_GBps"] for r in records if r["busbw_GBps"]), default=None)
    line = f"\nmemcpy (one core): {format_rate(memcpy)}"
    if best:
        line += f"; best bus bandwidth {format_rate(best)} = {best / memcpy:.0%} of it"
    print(line)
    if args.out:
        (records.to_csv if args.out.lower().endswith(".csv") else records.to_json)(args.out)
        print(f"records written to {args.out}")
    if args.plot:
        fig = records.plot(limit=memcpy, limit_label="memcpy, one core")[0].figure
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        fig.clf()  # free it without touching pyplot here (the plots layer made it)
        print(f"plot written to {args.plot}")
    wrong = [f"{r['op']} {r['bytes']} B" for r in records if r["status"] == "wrong"]
    if wrong:
        print(f"nbdist bench: wrong results for {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0
