"""``python -m nbdist mem``: the memory measurement and estimate from a terminal."""
from __future__ import annotations

import argparse
import importlib.util
import json
from typing import List

import torch

from .. import strategies as _strategies
from ..runtime.api import start
from .formulas import OPTIMIZERS, count_params, estimate, estimate_curve, model_spec
from .report import estimate_table, measure

def cli(argv: List[str]) -> int:
    """``python -m nbdist mem``: measure on a fresh group (or only estimate, for a count)."""
    parser = argparse.ArgumentParser(
        prog="nbdist mem", description="Per-rank memory of data-parallel strategies, measured on "
        "a fresh group and set against the ZeRO formulas. A parameter count as --model (e.g. 7.5B) "
        "gives the estimate only, for any world size.")
    parser.add_argument("--model", default="mlp:4x2236",
                        help="mlp:LAYERSxWIDTH (default mlp:4x2236, 20M params) or a count (7.5B)")
    parser.add_argument("--strategies", default="ddp,zero1,fsdp",
                        help="comma-separated, from: "
                        + ", ".join(_strategies.available_strategies()))
    parser.add_argument("--world-size", "-n", type=int, default=2)
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS))
    parser.add_argument("--precision", default="fp32", choices=_strategies.PRECISIONS)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--profile", action="store_true",
                        help="CPU: measure the step's peak with the torch profiler (slower)")
    parser.add_argument("--estimate", action="store_true", help="print the estimate only")
    parser.add_argument("--plot", metavar="PNG", help="save a plot to this file (matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="write the records as JSON")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    try:
        spec = model_spec(args.model)
        for name in names:
            _strategies.get_strategy(name)
        if isinstance(spec, int):
            num = spec
        else:
            with torch.device("meta"):  # count without allocating
                num = count_params(spec())
        estimate(num, args.world_size, 0, args.precision, args.optimizer)
    except ValueError as err:
        parser.error(str(err))
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install nbdist[notebook]")
    if isinstance(spec, int) or args.estimate:
        print(estimate_table(num, args.world_size, names, args.precision, args.optimizer))
        if args.plot:
            ax = estimate_curve(num, names, precision=args.precision,
                                optimizer=args.optimizer).plot(mark=args.world_size)
            ax.figure.savefig(args.plot, bbox_inches="tight")
        return 0
    with start(args.world_size, backend=args.backend) as group:
        report = measure(group, spec, names, args.optimizer, args.steps, args.batch,
                         precision=args.precision, profile=args.profile)
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dicts(), f, indent=1)
    if args.plot:
        report.plot().figure.savefig(args.plot, bbox_inches="tight")
    print(f"({len(report)} records; decimal units. 'state' = params + grads + optimizer, exact; "
          "'estimate' = the ZeRO formula; rss is approximate)")
    return 0
