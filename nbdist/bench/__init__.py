"""Collective benchmarks and traces: what all_reduce & co. cost on a group, and in your own code::

    import nbdist, nbdist.bench
    g = nbdist.start(4, backend="gloo")
    records = nbdist.bench.collectives(g, ops=["all_reduce", "all_gather"], sizes="4K-64M")
    records.plot(limit=nbdist.bench.memcpy_bandwidth(g))       # latency and bus bandwidth
    records.to_csv("bench.csv"); records.to_pandas()
    both = nbdist.bench.compare(g, [{"backend": "gloo"}, {"world_size": 2}], sizes="1M-16M")

    def step():                                  # on the ranks
        with nbdist.bench.trace() as tr:
            loss = ddp_model(batch).sum(); loss.backward()
        return tr
    tr = nbdist.bench.Trace.merge(g.run(step)); tr.summary(); tr.plot()

    def measured():                              # on the ranks: bytes per mesh dimension
        with nbdist.bench.traffic(mesh, steps=1) as t:
            train_step()
        return t
    nbdist.bench.Traffic.merge(g.run(measured)).compare(
        nbdist.bench.expected_traffic(model, "fsdp2+tp", tp=2, tokens=b * s, world_size=4))

Records follow nccl-tests' definitions (algbw, busbw; see :mod:`nbdist.bench.units`); the timing
method is described in :mod:`nbdist.bench.ops`. This package imports neither matplotlib nor
IPython; plots are drawn by :mod:`nbdist.ui.plots.collectives` when asked for.
"""
from .command import cli
from .expected import expected_traffic
from .records import FIELDS, NOISY_SPREAD, Records, Table
from .sweep import DEFAULT_SIZES, collectives, compare, memcpy_bandwidth, summarize
from .steps import step
from .trace import Summary, Trace, trace
from .traffic import Traffic, traffic
from .units import (OPS, bandwidths, bus_factor, format_bytes, format_rate, format_time,
                    parse_ops, parse_size, parse_sizes)

__all__ = sorted([
    "DEFAULT_SIZES",
    "FIELDS",
    "NOISY_SPREAD",
    "OPS",
    "Records",
    "Summary",
    "Table",
    "Trace",
    "Traffic",
    "bandwidths",
    "bus_factor",
    "cli",
    "collectives",
    "compare",
    "expected_traffic",
    "format_bytes",
    "format_rate",
    "format_time",
    "memcpy_bandwidth",
    "parse_ops",
    "parse_size",
    "parse_sizes",
    "step",
    "summarize",
    "trace",
    "traffic",
])
