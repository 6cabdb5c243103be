"""``python -m nbdist mem``: the memory measurement and estimate from a terminal."""
from __future__ import annotations

import argparse
import importlib.util
import json
from typing import List

import torch

from .. import strategies as _strategies
from ..report.units import dashed_values
from ..runtime.api import start
from .activations import estimate_options
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
    parallel = parser.add_argument_group(
        "model parallel (estimate only)", "Megatron-LM's dp x tp x pp layout and the activations "
        "per Korthikanti et al. 2022 (see nbdist.memory.estimate)")
    parallel.add_argument("--tp", type=int, help="tensor-parallel size")
    parallel.add_argument("--pp", type=int, help="pipeline stages")
    parallel.add_argument("--transformer", metavar="L=..,h=..,a=..,s=..[,b=..]",
                          help="transformer shape for the activations, e.g. L=32,h=4096,a=32,"
                               "s=2048,b=1")
    parallel.add_argument("--sequence-parallel", action="store_true")
    parallel.add_argument("--recompute", choices=("selective", "full"))
    parallel.add_argument("--microbatches", type=int, help="microbatches per pipeline step")
    parallel.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    parser.add_argument("--plot", metavar="PNG", help="save a plot to this file (matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="write the records as JSON")
    args = parser.parse_args(dashed_values(parser, argv))
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
        extra = estimate_options(args.tp, args.pp, args.transformer, args.sequence_parallel,
                                 args.recompute, args.microbatches, args.schedule)
        if extra and not (isinstance(spec, int) or args.estimate):
            raise ValueError("--tp, --pp, --transformer, --sequence-parallel, --recompute and "
                             "--microbatches apply to the estimate: give a parameter count as "
                             "--model (e.g. 7.5B) or add --estimate")
        for name in names:
            estimate(num, args.world_size, name, args.precision, args.optimizer, **extra)
    except ValueError as err:
        parser.error(str(err))
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("--plot needs matplotlib: pip install nbdist[notebook]")
    if isinstance(spec, int) or args.estimate:
        print(estimate_table(num, args.world_size, names, args.precision, args.optimizer,
                             **extra))
        if args.plot:
            ax = estimate_curve(num, names, precision=args.precision,
                                optimizer=args.optimizer, **{k: v for k, v in extra.items()
                                                             if k in ("tp", "pp")}
                                ).plot(mark=args.world_size)
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
