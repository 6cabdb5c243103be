"""Synthetic inputs for every plot, shaped like what the tutorials measure (03: a gloo sweep, a
comparison, a trace; 04/09: per-rank memory of eight strategies; 08: a live job with a straggler;
10: meshes and pipeline steps). Figures from 2-core CPU runs, rounded; nothing here is measured."""
import math

from nbdist.bench import OPS, Records, Trace, bus_factor
from nbdist.memory.report import MemoryRecord, MemoryReport
from nbdist.parallel import MeshLayout, Timeline
from nbdist.runtime.metrics import Metrics

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def sweep_records(world_sizes=(2,)):
    """Every op over 4 KiB-16 MiB on gloo: latency ~0.2 ms + bytes / 1.5 GB/s, barrier flat."""
    rows = []
    for n in world_sizes:
        for k, op in enumerate(OPS):
            for size in ([0] if op == "barrier" else SIZES):
                t = (0.15 + 0.05 * k) * 1e-3 * n / 2 + size / (1.5e9 / (1 + 0.2 * k))
                algbw = size / t / 1e9 if size else None
                rows.append(dict(op=op, bytes=size, count=size // 4, dtype="float32",
                                 world_size=n, backend="gloo", device="cpu", iters=20, warmup=5,
                                 time_s=t, mean_s=t * 1.05, p10_s=t * 0.95, p90_s=t * 1.2,
                                 rank_min_s=t * 0.9, rank_max_s=t,
                                 algbw_GBps=algbw,
                                 busbw_GBps=algbw * bus_factor(op, n) if size else None,
                                 status="ok", verified=True, note=None))
    return Records(rows)


def trace(ranks=2, steps=6):
    """A DDP-like step loop: per step one all_reduce per bucket, an all_gather, a barrier."""
    events, spans, t0 = [], {}, 1_700_000_000.0
    for rank in range(ranks):
        t = t0
        for _ in range(steps):
            for op, dur in (("all_reduce", 0.9e-3), ("all_reduce", 0.4e-3),
                            ("all_gather", 0.3e-3), ("barrier", 0.15e-3)):
                t += 1.2e-3
                events.append(dict(rank=rank, op=op, bytes=1 << 18, dtype="float32", start=t,
                                   issued=t, duration=dur))
                t += dur
        spans[rank] = (t0, t + 0.5e-3)
    return Trace.merge([Trace([e for e in events if e["rank"] == r], {r: spans[r]})
                        for r in range(ranks)])


def memory_report(world_size=2, psi=263_168, strategies=None):
    """09's eight strategies on 4 x Linear(256, 256), fp32 Adam: stages 1-3 shard optimizer,
    grads, params; stage 3 keeps gathered params and flat buffers, counted as "other"."""
    stage = {"ddp": 0, "zero1": 1, "fairscale_oss": 1, "deepspeed_zero1": 1, "fsdp_grad_op": 2,
             "fairscale_sharded": 2, "deepspeed_zero2": 2, "fsdp": 3, "deepspeed_zero3": 3}
    out = []
    for name, s in stage.items():
        if strategies is not None and name not in strategies:
            continue
        for rank in range(world_size):
            p, g, o = 4 * psi, 4 * psi, 8 * psi
            p, g, o = (p // world_size if s >= 3 else p, g // world_size if s >= 2 else g,
                       o // world_size if s >= 1 else o)
            other = 6 * psi if s == 3 else 8 + 4096 * rank
            out.append(MemoryRecord(name, rank, world_size, "cpu", psi, p, g, o, other,
                                    other + 50_000, None, 380_000_000, 370_000_000,
                                    {"params": "exact"}, [], estimate=p + g + o,
                                    formula="(P + G + K)Ψ"))
    return MemoryReport(out)


def mesh_layouts():
    """10's dp x tp mesh of 4 ranks, and a pp x dp x tp mesh of 8."""
    return MeshLayout(4, dp=2, tp=2), MeshLayout(8, pp=2, dp=2, tp=2)


def pipeline_timeline(schedule="gpipe", ranks=4, microbatches=4, fwd=0.4e-3, send=0.45e-3):
    """One step as 10 measures it on 2 cores: forward ``fwd``, backward twice that, a gloo send
    about a forward between stages; interleaved: stage ``s`` on rank ``s % ranks``, two a rank."""
    v = 2 if schedule == "interleaved1f1b" else 1
    stages = v * ranks
    free, done, events = [0.0] * ranks, {}, []
    for kind, order, cost in (("forward", range(stages), fwd),
                              ("backward", reversed(range(stages)), 2 * fwd)):
        order = list(order)
        for i in range(microbatches):
            previous = done.get(("forward", i, stages - 1)) if kind == "backward" else None
            for s in order:
                r = s % ranks
                start = max(free[r], previous + send if previous is not None else 0.0)
                free[r] = previous = done[(kind, i, s)] = start + cost / v
                events.append(dict(rank=r, stage=s, microbatch=i, kind=kind, start=start,
                                   end=start + cost / v))
    end = max(free)
    return Timeline.merge(Timeline(schedule, microbatches, ranks, stages,
                                   [e for e in events if e["rank"] == r], {r: (0.0, end)})
                          for r in range(ranks))


class LiveJob:
    """What the live view reads of a job: 08's training loop on 2 ranks, rank 1 with a slow data
    loader (10 ms a step), 120 steps logged through ``nbdist.step`` and ``nbdist.log``."""

    name, state, elapsed, stalled = "job", "done", 4.2, None

    def __init__(self, steps=120):
        self.metrics = Metrics()
        for i in range(steps):
            for rank in (0, 1):
                jitter = 1 + 0.15 * math.sin(1.7 * i + rank)  # a shared machine's noise
                compute = (0.0025 + (0.0102 if rank == 1 else 0.0)) * jitter
                comm = (0.0104 if rank == 0 else 0.0004) * jitter  # rank 0 waits for rank 1
                loss = 2.0 * math.exp(-i / 40) + 0.05 * rank
                self.metrics.add([(rank, i, "step_s", compute + comm, i * 0.013),
                                  (rank, i, "comm_s", comm, i * 0.013),
                                  (rank, i, "compute_s", compute, i * 0.013),
                                  (rank, i, "loss", loss, i * 0.013),
                                  (rank, i, "data_ms", 10.1 if rank == 1 else 0.05, i * 0.013)])

    def describe(self):
        return (f"job {self.name!r}: {self.state}, {self.elapsed:.1f} s (rank 0 step 119, rank 1 "
                "step 119); straggler: rank 1 (compute 2.58x the median)")

    def wait(self, timeout=None):
        return True

    def interrupt(self):
        raise AssertionError("the figure test never interrupts")

    def __repr__(self):
        return f"<nbdist.Job {self.describe()}>"


def live_job():
    """A finished job as the live view sees it (see :class:`LiveJob`)."""
    return LiveJob()
