"""nbdist.bench without processes: sizes, bus factors, the slowest-rank statistics, tables,
trace pairing and the sweep's argument checks (on a stand-in group)."""
import io
import pickle
import re
import sys

import pytest

from nbdist import bench
from nbdist.bench import Records, Table, Trace
from nbdist.bench.trace import _Ev, pair

pytestmark = pytest.mark.timeout(30)

META = dict(dtype="float32", world_size=4, backend="gloo", device="cpu", iters=3, warmup=1)


def ok(times, nbytes=10**9, verified=True):
    return {"status": "ok", "bytes": nbytes, "count": nbytes // 4, "times": times,
            "verified": verified, "note": None}


# ---- bus bandwidth ------------------------------------------------------------------------
@pytest.mark.parametrize("n,expected", [
    (2, {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5,
         "broadcast": 1.0, "reduce": 1.0, "send_recv": 1.0, "barrier": None}),
    (4, {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75,
         "broadcast": 1.0, "reduce": 1.0, "send_recv": 1.0, "barrier": None}),
    (8, {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875,
         "broadcast": 1.0, "reduce": 1.0, "send_recv": 1.0, "barrier": None}),
])
@pytest.mark.timeout(10)
def test_bus_factors_are_nccl_tests(n, expected):
    assert {op: bench.bus_factor(op, n) for op in bench.OPS} == expected


@pytest.mark.timeout(10)
def test_bandwidths():
    assert bench.bandwidths("all_reduce", 10**9, 1.0, 4) == (1.0, 1.5)
    assert bench.bandwidths("all_gather", 2 * 10**9, 0.5, 2) == (4.0, 2.0)
    assert bench.bandwidths("barrier", 0, 1e-5, 4) == (None, None)
    assert bench.bandwidths("all_reduce", 10**9, None, 4) == (None, None)


# ---- statistics of a point ----------------------------------------------------------------
@pytest.mark.timeout(10)
def test_summarize_takes_the_slowest_rank_per_iteration():
    rec = bench.summarize("all_reduce", [ok([1.0, 4.0, 2.0]), ok([3.0, 1.0, 8.0])], **META)
    # per iteration: max(1, 3) = 3, max(4, 1) = 4, max(2, 8) = 8; rank means 7/3 and 4
    assert rec["time_s"] == 4.0 and rec["mean_s"] == 4.0
    assert rec["p10_s"] == pytest.approx(3.2) and rec["p90_s"] == pytest.approx(7.2)
    assert (rec["rank_min_s"], rec["rank_max_s"]) == (2.0, 3.0)  # each rank's own median
    assert rec["spiked"] == pytest.approx(1 / 3)  # 8 > 2 x 3.2; 4 is not
    assert rec["algbw_GBps"] == 0.25 and rec["busbw_GBps"] == 0.25 * 1.5  # from the median
    assert rec["status"] == "ok" and rec["verified"] is True and rec["note"] is None
    assert list(rec) == list(bench.FIELDS)
    assert {k: rec[k] for k in META} == META


@pytest.mark.timeout(10)
def test_summarize_unsupported_wrong_and_idle_ranks():
    bad = {"status": "unsupported", "bytes": 8, "count": 2, "times": None, "verified": None,
           "note": "RuntimeError: Invalid scalar type"}
    rec = bench.summarize("all_reduce", [ok([1.0]), bad], **META)
    assert rec["status"] == "unsupported" and rec["time_s"] is None and rec["busbw_GBps"] is None
    assert rec["note"] == "rank 1: RuntimeError: Invalid scalar type"
    rec = bench.summarize("all_reduce", [ok([1.0]), ok([1.0], verified=False),
                                         ok([1.0], verified=False)], **META)
    assert rec["status"] == "wrong" and rec["verified"] is False
    assert rec["note"] == "the result differed from the expected values on ranks 1, 2"
    idle = ok(None)  # ranks > 1 take no part in send_recv
    rec = bench.summarize("send_recv", [ok([2.0, 4.0]), ok([3.0, 1.0]), idle], **META)
    assert rec["time_s"] == 3.5 and rec["mean_s"] == 3.0
    assert rec["algbw_GBps"] == pytest.approx(1 / 3.5)
    assert rec["busbw_GBps"] == rec["algbw_GBps"]


@pytest.mark.timeout(10)
def test_bandwidths_come_from_the_median_the_table_shows():
    # one spike (a rank that lost its core for a scheduler slice): the mean jumps, the median not
    times = [1e-4] * 9 + [41e-4]
    rec = bench.summarize("all_reduce", [ok(times, nbytes=10**6), ok(times, nbytes=10**6)],
                          **META)
    assert rec["time_s"] == 1e-4 and rec["mean_s"] == pytest.approx(5e-4)
    assert rec["algbw_GBps"] == pytest.approx(10**6 / rec["time_s"] / 1e9)
    assert rec["busbw_GBps"] == pytest.approx(rec["algbw_GBps"] * bench.bus_factor(
        "all_reduce", 4))
    head, _, row = str(Records([rec])).splitlines()[:3]
    cells = dict(zip(re.split(" {2,}", head), row.split()))
    assert "mean (µs)" not in cells  # one statistic in the table: the median
    nbytes, seconds = float(cells["size (KiB)"]) * 1024, float(cells["median (µs)"]) * 1e-6
    assert float(cells["algbw (GB/s)"]) == pytest.approx(nbytes / seconds / 1e9, rel=1e-2)


@pytest.mark.timeout(10)
def test_points_whose_iterations_disagree_are_flagged_noisy():
    steady = bench.summarize("all_reduce", [ok([1.0, 1.1, 1.2, 1.0, 1.1])] * 2, **META)
    spiky = bench.summarize("all_reduce", [ok([1.0, 1.1, 1.0, 5.0, 1.0])] * 2, **META)
    assert steady["noisy"] is False and spiky["noisy"] is True
    assert spiky["p90_s"] > bench.NOISY_SPREAD * spiky["p10_s"]
    text = str(Records([steady, spiky]))
    assert [line.split()[-2] for line in text.splitlines()[2:4]] == ["no", "yes"]
    assert "noisy: p90 > 2 x p10" in text
    assert "noisy:" not in str(Records([steady]))
    assert "median (p10, p90) of 3 iterations, slowest rank; algbw = size / median" in text


@pytest.mark.timeout(10)
def test_memcpy_limit_is_the_fastest_copy(monkeypatch):
    from nbdist.bench import ops

    ways = bench.memcpy_bandwidth(nbytes=1 << 20, repeats=1, each=True)
    assert set(ways) == set(ops.COPIES) and all(v > 0 for v in ways.values())
    monkeypatch.setattr(ops, "memcpy_all", lambda nbytes, repeats: {
        "memmove": 9.0, "torch copy_": 6.3, "numpy.copyto": 10.1})
    assert bench.memcpy_bandwidth() == 10.1


@pytest.mark.timeout(10)
def test_memcpy_without_numpy_times_the_other_two(monkeypatch):
    from nbdist.bench import ops

    monkeypatch.setitem(sys.modules, "numpy", None)  # torch runs without numpy
    assert set(ops.memcpy_all(1 << 16, 1)) == {"memmove", "torch copy_"}


# ---- sizes and ops ------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_parse_sizes():
    assert bench.parse_sizes("4K-64M") == [4096 << i for i in range(15)]
    assert bench.parse_sizes("4K-64M:4") == [4096 << (2 * i) for i in range(8)]
    assert bench.parse_sizes("1K, 1M") == [1024, 1 << 20]
    assert bench.parse_sizes("8,1K-4K,1K") == [8, 1024, 2048, 4096]
    assert bench.parse_sizes(100) == [100]
    assert bench.parse_sizes([3, "2K", 3]) == [3, 2048]
    assert bench.parse_sizes("1.5M") == [3 << 19]
    assert bench.parse_sizes("64MiB") == bench.parse_sizes("64mb") == [64 << 20]
    assert bench.parse_size("1G") == 1 << 30


@pytest.mark.parametrize("spec,message", [
    ("", "no sizes in ''; give e.g. '4K-64M' or '1K,1M'"),
    ("4X", "cannot read the size '4X': use a number with an optional unit B, K, M or G"),
    ("64M-4K", "the size range '64M-4K' goes down; put the smaller size first: '4K-64M'"),
    ("4K-64M:1", "the step in '4K-64M:1' must be a whole number of at least 2"),
    ("4K-64M:x", "the step in '4K-64M:x' must be a whole number"),
    ("0", "sizes must be at least 1 byte, got '0'"),
])
@pytest.mark.timeout(10)
def test_parse_sizes_mistakes(spec, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        bench.parse_sizes(spec)


@pytest.mark.timeout(10)
def test_parse_sizes_wrong_types():
    with pytest.raises(TypeError, match="sizes must be a str such as '4K-64M', an int or a list"):
        bench.parse_sizes(None)
    with pytest.raises(TypeError, match=r"a size is an int of bytes or a str such as '4K', got "
                                        r"float \(1.5\)"):
        bench.parse_sizes([1.5])


@pytest.mark.timeout(10)
def test_parse_ops():
    assert bench.parse_ops(None) == list(bench.OPS)
    assert bench.parse_ops(" all_reduce, barrier,all_reduce") == ["all_reduce", "barrier"]
    with pytest.raises(ValueError, match="unknown op 'allreduce'; valid ops: all_reduce, "):
        bench.parse_ops(["allreduce"])
    with pytest.raises(ValueError, match=r"unknown op \(none given\); valid ops"):
        bench.parse_ops("")


@pytest.mark.timeout(10)
def test_formats():
    assert bench.format_bytes(4096) == "4 KiB" and bench.format_bytes(3 << 19) == "1.5 MiB"
    assert bench.format_bytes(100) == "100 B" and bench.format_bytes(None) == "-"
    assert bench.format_time(1.2e-5) == "12 µs" and bench.format_time(0.0031) == "3.1 ms"
    assert bench.format_time(2.0) == "2 s" and bench.format_time(5e-8) == "50 ns"
    assert bench.format_rate(2.5) == "2.5 GB/s" and bench.format_rate(0.012) == "0.012 GB/s"


# ---- tables -------------------------------------------------------------------------------
def _records():
    a = bench.summarize("all_reduce", [ok([1e-3, 2e-3]), ok([3e-3, 1e-3])], **META)
    b = bench.summarize("barrier", [ok([1e-5], nbytes=0)] * 2, **META)
    return Records([a, b])


@pytest.mark.timeout(10)
def test_csv_and_json_round_trip(tmp_path):
    records = _records()
    assert Records.from_csv(io.StringIO(records.to_csv())) == records
    assert Records.from_json(io.StringIO(records.to_json())) == records
    records.to_csv(tmp_path / "r.csv")
    records.to_json(tmp_path / "r.json")
    again = Records.from_csv(tmp_path / "r.csv")
    assert again == records and isinstance(again, Records)
    assert Records.from_json(tmp_path / "r.json") == records
    with pytest.raises(ValueError, match="expected a JSON list of records .objects., as to_json"):
        Records.from_json(io.StringIO('{"op": "all_reduce"}'))


@pytest.mark.timeout(10)
def test_table_text_html_and_joins():
    records = _records()
    text = str(records)
    assert re.split(" {2,}", text.splitlines()[0]) == [  # one unit per column, in its header
        "op", "size (MiB)", "world_size", "backend", "median (µs)", "p10 (µs)", "p90 (µs)",
        "algbw (GB/s)", "busbw (GB/s)", "spiked (%)", "noisy", "status"]
    assert text.splitlines()[2].split()[:2] == ["all_reduce", "954"]  # 10**9 B in MiB
    assert text.splitlines()[2].split()[4:7] == ["2500", "2100", "2900"]  # µs, as the header
    assert "<table>" in records._repr_html_() and "barrier" in records._repr_html_()
    both = Records.concat([records, records])
    assert len(both) == 4 and isinstance(both, Records) and isinstance(records + records, Records)
    assert len(both.where(op="barrier")) == 2
    assert Table([{"a": 1}, {"b": None}]).format() == "a  b\n----\n1  -\n-  -"


@pytest.mark.timeout(60)  # pandas' first import: over 10 s under Wine beside another pytest
def test_to_pandas(monkeypatch):
    records = _records()
    try:
        import pandas  # noqa: F401
    except ImportError:
        pandas = None
    if pandas is not None:
        frame = records.to_pandas()
        assert list(frame.columns) == list(bench.FIELDS) and len(frame) == 2
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(ImportError, match=r"to_pandas\(\) needs pandas \(pip install pandas\); "
                                          r"to_csv\(\) and to_json\(\) work without it"):
        records.to_pandas()


# ---- trace --------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_pair_calls_with_executions_in_order():
    calls = [_Ev("c10d::allreduce_", 100, 5), _Ev("c10d::_reduce_scatter_base_", 110, 5, 64,
                                                  "float"),
             _Ev("c10d::barrier", 300, 5, 1, "unsigned char"), _Ev("c10d::foo_", 400, 7)]
    execs = [_Ev("gloo:broadcast", 50, 10, 8),  # issued before the trace began
             _Ev("gloo:all_reduce", 120, 30, 32), _Ev("gloo:all_reduce", 125, 40, 64),
             _Ev("gloo:barrier", 310, 2)]
    events = pair(calls, execs, rank=3)
    assert [(e["op"], e["bytes"], round(e["start"] * 1e9), round(e["duration"] * 1e9))
            for e in events] == [
        ("broadcast", 8, 50, 10), ("all_reduce", 32, 120, 30), ("reduce_scatter", 64, 125, 40),
        ("barrier", None, 310, 2), ("foo", None, 400, 7)]
    assert {e["rank"] for e in events} == {3}
    assert round(events[1]["issued"] * 1e9) == 100 and events[2]["dtype"] == "float"


def _trace():
    a = Trace([{"rank": 0, "op": "all_reduce", "bytes": 100, "dtype": "float", "start": 1.0,
                "duration": 0.2, "issued": 1.0},
               {"rank": 0, "op": "all_gather", "bytes": 50, "dtype": "float", "start": 1.5,
                "duration": 0.1, "issued": 1.5}], {0: (1.0, 2.0)})
    b = Trace([{"rank": 1, "op": "all_reduce", "bytes": 300, "dtype": "float", "start": 1.1,
                "duration": 0.4, "issued": 1.1}], {1: (1.0, 2.0)})
    return Trace.merge([a, b])


@pytest.mark.timeout(10)
def test_trace_merge_summary_and_pickle():
    tr = _trace()
    assert len(tr) == 3 and [e["rank"] for e in tr] == [0, 1, 0] and set(tr.spans) == {0, 1}
    rows = {r["op"]: r for r in tr.summary()}
    assert rows["all_reduce"]["calls"] == 1 and rows["all_reduce"]["bytes"] == 200
    assert rows["all_reduce"]["time_s"] == pytest.approx(0.3)  # per rank, averaged
    assert rows["all_reduce"]["share"] == pytest.approx(0.3)  # of the 1 s traced per rank
    assert rows["all_gather"]["calls"] == 0.5 and list(rows) == ["all_reduce", "all_gather"]
    text = str(tr.summary())
    assert "time (ms)  mean (ms)  share (%)" in text.splitlines()[0]
    assert text.splitlines()[2].split()[-3:] == ["300", "300", "30.0"]
    again = pickle.loads(pickle.dumps(tr))
    assert again.events == tr.events and again.spans == tr.spans
    assert tr.to_records()[0]["op"] == "all_reduce" and "3 collectives" in repr(tr)
    with pytest.raises(TypeError, match=r"Trace.merge\(\) takes Trace objects .* got list"):
        Trace.merge([tr, []])


# ---- sweep arguments, on a stand-in group --------------------------------------------------
class FakeGroup:
    """Enough of nbdist.Group for the sweep: answers every call with the same fake times."""

    def __init__(self, world_size=2, backend="gloo", device="cpu", memory=64 << 30):
        self.world_size, self.backend, self.device = world_size, backend, device
        self.calls, self.restarts = [], []
        self.memory, self.memory_checks = memory, 0  # the host's available bytes, asked before

    def call(self, fn, args=(), kwargs=None, ranks=None, timeout=None):
        if fn.__name__ == "free_memory":  # the sweep's memory check, before the first point
            self.memory_checks += 1
            return [("host", self.memory)] * self.world_size
        self.calls.append((fn.__name__, args))
        return [ok([1e-3, 2e-3], nbytes=args[1])] * self.world_size

    def restart(self, **opts):
        self.restarts.append(opts)
        self.world_size = opts.get("world_size", self.world_size)
        self.backend = opts.get("backend", self.backend)
        self.device = opts.get("device", self.device)


@pytest.mark.timeout(10)
def test_sweep_points_and_send_recv_on_one_rank():
    g = FakeGroup(world_size=1)
    records = bench.collectives(g, ops="all_reduce,barrier,send_recv", sizes="1K-2K",
                                progress=False)
    assert [(r["op"], r["bytes"]) for r in records] == [
        ("all_reduce", 1024), ("all_reduce", 2048), ("barrier", 0), ("send_recv", 1024),
        ("send_recv", 2048)]
    assert len(g.calls) == 3  # send_recv never reached the ranks
    assert records[-1]["status"] == "unsupported"
    assert records[-1]["note"] == ("send_recv needs at least 2 ranks (a ping-pong between "
                                   "ranks 0 and 1)")


@pytest.mark.timeout(10)
def test_sizes_that_do_not_fit_the_hosts_memory_are_refused_before_any_point():
    g = FakeGroup(world_size=4, memory=10 << 30)  # 4 ranks on one host with 10 GiB available
    with pytest.raises(ValueError) as info:
        bench.collectives(g, ops="all_reduce,all_gather", sizes="1K,1G", progress=False)
    assert str(info.value) == (
        "the largest size, 1 GiB, does not fit in memory: all_gather at that size needs about "
        "3.5 GiB on each rank (its buffers, and a float64 copy to check the result), 14 GiB for "
        "the 4 ranks on host, which has 10 GiB available (a sweep uses at most 80%). Use sizes "
        "up to 512 MiB here, e.g. '4K-512M'.")
    assert g.memory_checks == 1 and not g.calls
    bench.collectives(g, ops="all_reduce,all_gather", sizes="1K,512M", progress=False)
    assert len(g.calls) == 4


@pytest.mark.parametrize("kwargs,message", [
    ({"ops": "all_reduce,nope"}, "unknown op 'nope'; valid ops"),
    ({"iters": 0}, "iters must be an int of at least 1, got 0"),
    ({"warmup": -1}, "warmup must be an int of at least 0, got -1"),
    ({"dtype": "complex64"}, "dtype must be a real floating-point or integer torch dtype, such "
                             "as torch.float32 or 'bfloat16'; got 'complex64'"),
    ({"dtype": "floaty"}, "dtype must be a real floating-point or integer torch dtype"),
])
@pytest.mark.timeout(10)
def test_sweep_argument_mistakes(kwargs, message):
    g = FakeGroup()
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        bench.collectives(g, progress=False, **kwargs)
    assert not g.calls


@pytest.mark.timeout(10)
def test_compare_restarts_per_config_and_restores():
    g = FakeGroup(world_size=2)
    records = bench.compare(g, [{}, {"world_size": 4}, {"world_size": 4}, {"backend": "gloo"}],
                            ops="all_reduce", sizes="1K", progress=False)
    assert [r["world_size"] for r in records] == [2, 4, 4, 2]
    base = {"backend": "gloo", "device": "cpu"}
    assert g.restarts == [dict(base, world_size=4), dict(base, world_size=2)]
    assert g.world_size == 2


@pytest.mark.parametrize("configs,error,message", [
    ([], TypeError, "configs must be a non-empty list of dicts of restart"),
    ({"backend": "gloo"}, TypeError, "configs must be a non-empty list"),
    ([{"threads": 1}], ValueError, r"compare\(\) configs may set world_size, backend, device; "
                                   r"config \{'threads': 1\} also has threads"),
    ([{}, {"backend": "nope"}], Exception, "nope"),
])
@pytest.mark.timeout(10)
def test_compare_checks_every_config_first(configs, error, message):
    g = FakeGroup()
    with pytest.raises(error, match=message):
        bench.compare(g, configs, ops="all_reduce", sizes="1K", progress=False)
    assert not g.calls and not g.restarts


@pytest.mark.timeout(10)
def test_memcpy_bandwidth_here_and_arguments():
    assert bench.memcpy_bandwidth(nbytes="1M", repeats=2) > 0
    with pytest.raises(ValueError, match="repeats must be an int of at least 1, got 0"):
        bench.memcpy_bandwidth(repeats=0)
