"""``%dist_start``'s options for engines that place the ranks (``--on slurm``, ``--on ray``,
``--on k8s``): the flags, and the engine options they make."""
from __future__ import annotations

from typing import Any, Callable, Dict

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from .base import _positive, _resource

#: (flag, argparse keywords) of each engine option, in the order ``--help`` lists them
FLAGS = [
    ("--nodes", dict(type=_positive(int), metavar="N", help="engine: number of nodes")),
    ("--ntasks-per-node", dict(type=_positive(int), metavar="N", help="engine: ranks per node")),
    ("--partition", dict(metavar="P", help="slurm: the partition")),
    ("--time", dict(metavar="T", help="slurm: the job's time limit (1:00:00)")),
    ("--account", dict(metavar="A", help="slurm: the account")),
    ("--qos", dict(metavar="Q", help="slurm: the QOS")),
    ("--gres", dict(metavar="G", help="slurm: generic resources (gpu:4)")),
    ("--constraint", dict(metavar="C", help="slurm: node features")),
    ("--sbatch-arg", dict(action="append", default=[], metavar="ARG",
                          help="slurm: one more sbatch argument (repeat it: --sbatch-arg=--mem=8G)")),
    ("--num-cpus", dict(type=float, metavar="N", help="ray: CPUs per rank (1)")),
    ("--num-gpus", dict(type=float, metavar="N", help="ray: GPUs per rank (0)")),
    ("--placement", dict(metavar="P", help="ray: PACK (default), SPREAD, STRICT_SPREAD or "
                                           "STRICT_PACK")),
    ("--address", dict(metavar="A", help="ray: auto (a running cluster), ray://HOST:PORT (Ray "
                                         "Client); default: start Ray here")),
    ("--resource", dict(action="append", default=[], type=_resource, metavar="NAME=N",
                        help="ray: a custom resource per rank (repeat it: --resource TPU=1)")),
    ("--image", dict(metavar="IMAGE", help="k8s: the ranks' image (default: the notebook pod's)")),
    ("--namespace", dict(metavar="NS", help="k8s: the namespace (default: the notebook pod's)")),
    ("--gpus", dict(type=_positive(int), metavar="N", help="k8s: nvidia.com/gpu per pod")),
    ("--service-account", dict(metavar="SA", help="k8s: the ranks' service account")),
    ("--keep-alive", dict(metavar="T", help="engine: the ranks outlive this kernel for T (30m, 2h, "
                                            "or seconds), for --reattach in the next one")),
]
#: each engine flag by its option's name (``"sbatch_arg"`` -> ``"--sbatch-arg"``)
ENGINE_FLAGS = {flag[2:].replace("-", "_"): flag for flag, _ in FLAGS}


def engine_arguments(fn: Callable) -> Callable:
    """``fn`` (a magic) with every engine flag as an argument."""
    for flag, keywords in reversed(FLAGS):
        fn = argument(flag, **keywords)(fn)
    return fn


def engine_options(args: Any) -> Dict[str, Any]:
    """The engine options the parsed ``args`` set; :class:`UsageError` when they are set for a
    local group (they would be ignored)."""
    engine = {k: v for k, v in vars(args).items() if k in ENGINE_FLAGS and v}
    if args.on == "local" and engine:
        raise UsageError(f"{', '.join(ENGINE_FLAGS[k] for k in engine)}: options of an engine "
                         "that places the ranks; add --on slurm, --on ray, --on k8s (or another "
                         "engine).")
    if "sbatch_arg" in engine:
        engine["sbatch_args"] = engine.pop("sbatch_arg")
    if "resource" in engine:
        engine["resources"] = dict(engine.pop("resource"))
    return engine
