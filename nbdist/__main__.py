"""Command line: ``python -m nbdist doctor | demo | bench | mem``.

``doctor`` prints what nbdist sees on this machine: torch version, devices, which backends are
usable (and why not, for the others), which one ``"auto"`` picks here, and whether DeepSpeed is
installed (which accelerator and communication backend it picks, whether a C++ compiler is there
for its ops; asked in a subprocess, so nbdist itself never imports DeepSpeed), and which
parallelism beyond data parallel runs here (context parallel does not, on CPU). ``demo`` starts a small
group, runs an all_reduce on it and prints the per-rank results.
"""
from __future__ import annotations

import argparse
import platform
import sys
from typing import List, Optional


def doctor() -> int:
    """Print the environment report; return the exit code."""
    import torch

    from . import __version__, backends

    print(f"nbdist {__version__}, torch {torch.__version__}, Python {platform.python_version()} "
          f"on {platform.system()} {platform.machine()}")
    cuda = torch.cuda.is_available()
    print(f"devices: cpu ({__import__('os').cpu_count()} cores)"
          + (f", cuda x{torch.cuda.device_count()} ({torch.cuda.get_device_name(0)})" if cuda
             else ", no CUDA device visible"))
    for device in ["cpu"] + (["cuda"] if cuda else []):
        print(f"backends for {device}:")
        for name, ok, reason in backends.backend_report(device):
            print(f"  {'+' if ok else '-'} {name:8s} {reason}")
        choice = backends.resolve_backend("auto", device)
        why = choice.note or ("NCCL is the fastest for CUDA tensors" if choice.backend == "nccl"
                              else "gloo handles CPU tensors on every platform")
        env = f" (${backends.ENV_VAR} is set)" if __import__("os").environ.get(backends.ENV_VAR) else ""
        print(f"  auto picks {choice.backend!r} for {device}{env}: {why}")
    from .strategies.deepspeed_doctor import doctor_lines

    print("\n".join(doctor_lines()))
    from .parallel.meshes import doctor_lines as parallel_lines

    print("\n".join(parallel_lines()))
    return 0


def demo(world_size: int) -> int:
    """Start a group, all_reduce on it, print per-rank values, stop."""
    import nbdist

    with nbdist.start(world_size) as g:
        print(g)
        out = g.exec("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nprint('rank', rank, "
                     "'sees', t.tolist())\nt.tolist()")
        print("per-rank results:", out)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m nbdist`` and the ``nbdist`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from .bench import cli

        return cli(argv[1:])
    if argv and argv[0] == "mem":
        from .memory import cli

        return cli(argv[1:])
    parser = argparse.ArgumentParser(prog="nbdist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="what nbdist sees on this machine")
    sub.add_parser("bench", help="collective benchmark sweep (see: nbdist bench --help)")
    sub.add_parser("mem", help="per-rank sharded memory vs the ZeRO formulas (nbdist mem --help)")
    p_demo = sub.add_parser("demo", help="start a group and all_reduce on it")
    p_demo.add_argument("--world-size", "-n", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    return demo(args.world_size)


if __name__ == "__main__":
    sys.exit(main())
