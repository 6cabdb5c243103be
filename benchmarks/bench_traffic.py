"""Measured against analytic bytes per mesh dimension (issue 19), gloo on CPU.

For each world size and strategy: a small transformer (``--blocks`` nbdist.parallel
TransformerBlocks, a norm and a head), wrapped with ``tp`` (with and without sequence parallel),
``fsdp2+tp`` or ``hsdp`` (``dp_replicate x dp_shard``), or split into a 1F1B pipeline (one stage
per rank, 4 microbatches: the ``pp`` dimension's sends and recvs), one warm-up step, then
``--steps`` steps under :func:`nbdist.bench.traffic`; per mesh dimension and op, the measured calls
and bytes per rank and step (nccl-tests' size) next to :func:`nbdist.bench.expected_traffic`'s
algorithmic figure, their ratio, and what each rank sends per step with NCCL's algorithms and
here on gloo (whose reduce_scatter is a whole all_reduce: twice NCCL's)::

    python benchmarks/bench_traffic.py            # 2 and 4 ranks, dim 256, batch 4 x 64
    python benchmarks/bench_traffic.py --quick    # dim 64, batch 4 x 16, 1 step
"""
from __future__ import annotations

import argparse
import time

import nbdist
from nbdist.bench import Traffic

SP, PP = {"sequence_parallel": True}, {"schedule": "1f1b", "microbatches": 4}
SETUPS = {2: [("tp", {}), ("tp", SP), ("pp", PP)],
          4: [("tp", {}), ("tp", SP), ("fsdp2+tp", {"tp": 2}), ("hsdp", {"dp_shard": 2}),
              ("pp", PP)]}


def measure(name, options, dim, heads, blocks, batch, seq, steps):
    import torch
    import torch.distributed as dist

    from nbdist import bench, parallel, strategies

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[parallel.TransformerBlock(dim, heads) for _ in range(blocks)],
                                torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim))
    world = dist.get_world_size()
    expected = bench.expected_traffic(model, name, tokens=batch * seq, world_size=world,
                                      **options)
    mesh = parallel.device_mesh(**strategies.mesh_sizes(name, world, **options))
    x = torch.randn(batch, seq, dim)
    if name == "pp":  # one stage per rank; the loss on the last stage's output
        pipe = parallel.pipeline(model, loss_fn=lambda out, _: out.square().mean(), **options)

        def step():
            pipe.step(x, x)
    else:
        wrapped, opt = strategies.wrap(name, model, torch.optim.SGD, **options)

        def step():
            wrapped(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    step()
    t0 = time.perf_counter()
    with bench.traffic(mesh, steps=steps) as tr:
        for _ in range(steps):
            step()
    return tr, expected, (time.perf_counter() - t0) / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="dim 64, batch 4 x 16, 1 step")
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.batch, args.seq, args.steps = 64, 4, 16, 1
    print(f"model: {args.blocks} x TransformerBlock(dim={args.dim}, heads={args.heads}) + "
          f"LayerNorm + Linear; batch {args.batch} x {args.seq}; {args.steps} measured step(s)")
    for p in args.ranks:
        with nbdist.start(p, backend="gloo", device="cpu", timeout=60) as g:
            for name, options in SETUPS.get(p, [("tp", {})]):
                t0 = time.perf_counter()
                out = g.run(measure, name, options, args.dim, args.heads, args.blocks,
                            args.batch, args.seq, args.steps)
                table = Traffic.merge(tr for tr, _, _ in out).compare(out[0][1])
                step_ms = max(s for _, _, s in out) * 1e3
                print(f"\n{name} {options or ''} on {p} ranks (step {step_ms:.0f} ms under the "
                      f"tap; {time.perf_counter() - t0:.1f} s)")
                print(table.format())


if __name__ == "__main__":
    main()
