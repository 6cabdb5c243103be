"""A 100 MiB tensor each way on a local group, by the paths a large tensor can take: shared files
beside the message (Linux and macOS by default) and inside the message (Windows' only way;
``NBDIST_TENSORS=message`` elsewhere), in one run.

    python benchmarks/bench_tensor_paths.py [--reps 5] [--mib 100] [--out bench_tensor_paths.json]

World size 2, gloo, CPU. Per path: a group, then ``--reps`` times a push of one tensor to both
ranks, and a pull of one tensor from rank 0 (``pull("y", ranks=[0])``). The paths alternate per
rep order. Runs under the Windows python.exe too, where only the message path exists.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import log, summary  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib", type=int, default=100)
    ap.add_argument("--out", default="bench_tensor_paths.json")
    args = ap.parse_args(argv)

    import torch

    import nbdist
    from nbdist.wire import segments

    paths = ["shared", "message"] if segments.SHARED_FILES else ["message"]
    samples = {p: {"push": [], "pull": []} for p in paths}
    big = torch.ones(args.mib << 18)  # float32: 4 bytes each
    for path in paths:
        with nbdist.start(2, env={segments.ENV_VAR: path}, timeout=300) as g:
            os.environ[segments.ENV_VAR] = path  # the caller's side of a push follows it too
            g.exec(f"y = torch.ones({args.mib << 18})")
            g.pull("y", ranks=[0])  # warm: the ranks' result pool, the first allocation
            for rep in range(args.reps):
                t0 = time.perf_counter()
                g.push(x=big)
                t1 = time.perf_counter()
                (y,) = g.pull("y", ranks=[0])
                t2 = time.perf_counter()
                assert y.numel() == big.numel()
                del y
                samples[path]["push"].append(t1 - t0)
                samples[path]["pull"].append(t2 - t1)
                log(f"{path} rep {rep}: push {1e3 * (t1 - t0):.0f} ms, pull {1e3 * (t2 - t1):.0f} ms")
            os.environ.pop(segments.ENV_VAR, None)
    print(f"{args.mib} MiB, world size 2, {args.reps} reps, {sys.platform}")
    print(f"{'path':<8} {'what':<5} {'median ms':>10} {'p10':>8} {'p90':>8}")
    for path, series in samples.items():
        for name, xs in series.items():
            s = summary([1e3 * x for x in xs])
            print(f"{path:<8} {name:<5} {s['median']:10.0f} {s['p10']:8.0f} {s['p90']:8.0f}")
    with open(args.out, "w") as f:
        json.dump({"mib": args.mib, "platform": sys.platform, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
