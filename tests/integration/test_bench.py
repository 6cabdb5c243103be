"""nbdist.bench on real ranks (2, gloo, small sizes): every op, unsupported ops, exports, plots,
traces of DDP and FSDP, the CLI. No timing assertions: the machine is shared and noisy."""
import json
import pickle
import sys

import matplotlib
import pytest

import nbdist
from nbdist import bench
from nbdist.bench import Records, Trace

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nbdist.ui.plots import collectives as plots  # noqa: E402

SWEEP = dict(sizes="4K,64K", iters=3, warmup=1, progress=False)


def notebook_function(source: str, name: str):
    """Define a function as a notebook cell would: in ``__main__``, so it ships by value."""
    ns = {"__name__": "__main__"}
    exec(source, ns)
    return ns[name]


@pytest.fixture(scope="module")
def records(shared_group):
    return bench.collectives(shared_group, **SWEEP)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


@pytest.mark.timeout(120)
def test_every_op_runs_and_verifies(records):
    assert [(r["op"], r["bytes"]) for r in records] == [
        (op, size) for op in bench.OPS for size in ([0] if op == "barrier" else [4096, 65536])]
    for r in records:
        assert list(r) == list(bench.FIELDS)
        assert r["status"] == "ok" and r["verified"] is True and r["note"] is None, r
        assert (r["world_size"], r["backend"], r["device"], r["dtype"]) == (2, "gloo", "cpu",
                                                                            "float32")
        assert (r["iters"], r["warmup"]) == (3, 1)
        assert 0 < r["p10_s"] <= r["time_s"] <= r["p90_s"]
        assert 0 < r["rank_min_s"] <= r["rank_max_s"]
        if r["op"] == "barrier":
            assert r["algbw_GBps"] is None and r["busbw_GBps"] is None
        else:
            assert r["count"] == r["bytes"] // 4
            assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bench.bus_factor(r["op"], 2))


@pytest.mark.parametrize("dtype", ["uint8", "int64", "bfloat16"])
@pytest.mark.timeout(120)
def test_other_dtypes_verify(shared_group, dtype):
    out = bench.collectives(shared_group, sizes="1K", dtype=dtype, iters=1, warmup=0,
                            progress=False)
    assert [(r["status"], r["verified"], r["dtype"]) for r in out] == [("ok", True, dtype)] * 8


@pytest.mark.timeout(120)
def test_an_op_or_dtype_the_backend_lacks_is_reported(shared_group):
    out = bench.collectives(shared_group, ops="all_reduce,barrier", sizes="4K",
                            dtype="float8_e4m3fn", iters=2, warmup=0, progress=False)
    assert out[0]["status"] == "unsupported" and out[0]["time_s"] is None
    assert out[0]["note"] == "ranks 0, 1: RuntimeError: Invalid scalar type"
    assert out[1]["status"] == "ok"  # the sweep went on
    assert shared_group.run(lambda: 1) == [1, 1]


BROKEN = '''
import torch
from nbdist.backends import store as store_backend

class Broken(store_backend.StoreProcessGroup):
    """The store backend, without all_to_all and with an all_reduce that does nothing."""

    def all_to_all_single(self, *args):
        raise NotImplementedError("no all_to_all in this backend")

    alltoall_base = all_to_all_single

    def allreduce(self, tensors, opts):
        return store_backend._completed_work(tensors)

def create(store, rank, world_size, timeout):
    return Broken(store, rank, world_size, timeout, name="nbbroken")
'''


@pytest.fixture
def broken_backend():
    nbdist.register_backend("nbbroken", notebook_function(BROKEN, "create"), devices=["cpu"])
    yield "nbbroken"
    nbdist.backends.unregister_backend("nbbroken")


@pytest.mark.timeout(120)
def test_custom_backend_lacking_an_op_and_giving_wrong_results(broken_backend, capsys, tmp_path):
    with nbdist.start(2, backend=broken_backend, timeout=30) as g:
        out = bench.collectives(g, ops="all_to_all,all_reduce,broadcast", sizes="4K", iters=2,
                                warmup=0, progress=False)
    assert [r["status"] for r in out] == ["unsupported", "wrong", "ok"]
    assert out[0]["note"] == "ranks 0, 1: NotImplementedError: no all_to_all in this backend"
    assert out[1]["note"] == "the result differed from the expected values on ranks 0, 1"
    assert out[1]["verified"] is False and out[1]["time_s"] > 0
    assert [r["backend"] for r in out] == ["nbbroken"] * 3
    rc = bench.cli(["-n", "2", "-b", broken_backend, "--ops", "all_reduce", "--sizes", "1K",
                    "--iters", "1", "--warmup", "0", "--no-progress"])
    assert rc == 1
    assert "nbdist bench: wrong results for all_reduce 1024 B" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_csv_and_json_round_trip(records, tmp_path):
    records.to_csv(tmp_path / "r.csv")
    records.to_json(tmp_path / "r.json")
    assert Records.from_csv(tmp_path / "r.csv") == records
    assert Records.from_json(tmp_path / "r.json") == records
    assert json.loads(records.to_json())[0]["op"] == "all_reduce"


@pytest.mark.timeout(120)
def test_to_pandas(records):
    pytest.importorskip("pandas")
    frame = records.to_pandas()
    assert list(frame.columns) == list(bench.FIELDS) and len(frame) == len(records)


@pytest.mark.timeout(120)
def test_plots_have_a_line_per_op_and_the_limit(records):
    lat, bw = records.plot(limit=4.0, limit_label="memcpy")
    assert lat.figure is bw.figure
    labels = [line.get_label() for line in lat.get_lines()]
    assert labels == [op for op in bench.OPS if op != "barrier"] + ["barrier"]
    assert all(len(line.get_xdata()) == 2 for line in lat.get_lines()[:-1])
    assert lat.get_xscale() == "log" and lat.get_yscale() == "log"
    bw_labels = [line.get_label() for line in bw.get_lines()]
    assert bw_labels[:-1] == [op for op in bench.OPS if op != "barrier"]
    top = max(r["busbw_GBps"] for r in records if r["busbw_GBps"])
    assert bw_labels[-1] == ("memcpy (4 GB/s)" if 4.0 <= 1.5 * top else  # near: a line
                             "memcpy (4 GB/s): above the plot")  # far: named, not drawn
    assert [t.get_text() for t in lat.get_xticklabels()] == ["4 KiB", "64 KiB"]
    assert records.plot("latency").get_title() == "latency"
    fig, ax = plt.subplots()
    assert records.plot("busbw", ax=ax) is ax
    mixed = Records.concat([records, [dict(r, world_size=4) for r in records]])
    labels = [line.get_label() for line in plots.plot_busbw(mixed).get_lines()]
    assert "all_reduce n=2" in labels and "all_reduce n=4" in labels
    with pytest.raises(ValueError, match="kind must be 'both', 'latency' or 'busbw', got 'bw'"):
        records.plot("bw")
    with pytest.raises(ValueError, match=r"plot_collectives\(\) draws into two Axes .latency, "
                                         r"bandwidth., got 1"):
        plots.plot_collectives(records, ax=[ax])


@pytest.mark.timeout(60)
def test_progress_bar(shared_group, capsys):
    bench.collectives(shared_group, ops="barrier", iters=1, warmup=0, progress=True)
    assert "gloo x2" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_memcpy_bandwidth_on_the_ranks(shared_group):
    assert bench.memcpy_bandwidth(shared_group, nbytes=1 << 20, repeats=2) > 0


@pytest.mark.timeout(180)
def test_compare_restarts_and_restores(group):
    out = bench.compare(group, [{}, {"world_size": 1}], ops="all_reduce", sizes="4K", iters=2,
                        warmup=0, progress=False)
    assert [(r["world_size"], r["status"]) for r in out] == [(2, "ok"), (1, "ok")]
    assert out[1]["busbw_GBps"] == 0.0  # one rank: nothing crosses a bus
    assert group.world_size == 2 and group.run(lambda: 1) == [1, 1]


DDP_STEP = '''
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import nbdist.bench

def step():
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1)))
    x = torch.randn(4, 16)
    model(x).sum().backward()                     # first step: DDP builds its buckets
    with nbdist.bench.trace() as tr:
        model(x).sum().backward()
        dist.all_gather_into_tensor(torch.empty(2000, dtype=torch.float16),
                                    torch.ones(1000, dtype=torch.float16))
        dist.barrier()
    grads_synced = all(p.grad is not None for p in model.parameters())
    return tr, grads_synced
'''


@pytest.mark.timeout(120)
def test_trace_records_ddp_all_reduce_during_backward(shared_group):
    out = shared_group.run(notebook_function(DDP_STEP, "step"))
    assert all(synced for _, synced in out)
    tr = Trace.merge(t for t, _ in out)
    assert set(tr.spans) == {0, 1}
    params = (16 * 16 + 16 + 16 + 1) * 4  # one gradient bucket, float32
    for rank in (0, 1):
        mine = [e for e in tr if e["rank"] == rank]
        reduces = [e for e in mine if e["op"] == "all_reduce"]
        assert [(e["bytes"], e["dtype"]) for e in reduces] == [(params, "float32")]
        begin, end = tr.spans[rank]
        assert begin <= reduces[0]["issued"] <= reduces[0]["start"] <= end
        assert reduces[0]["duration"] > 0
        gathers = [e for e in mine if e["op"] == "all_gather"]
        assert [(e["bytes"], e["dtype"]) for e in gathers] == [(4000, "float16")]
        assert [e["bytes"] for e in mine if e["op"] == "barrier"] == [None]
    summary = {row["op"]: row for row in tr.summary()}
    assert summary["all_reduce"]["calls"] == 1 and summary["all_reduce"]["bytes"] == params
    assert 0 < summary["all_reduce"]["share"] < 1
    assert "all_reduce" in str(tr.summary())
    assert pickle.loads(pickle.dumps(tr)).events == tr.events
    ax = tr.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"all_reduce", "all_gather",
                                                                   "barrier"}


FSDP_STEP = '''
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import nbdist.bench

def step():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 32)
    with nbdist.bench.trace() as tr:
        model(x).sum().backward()
    return tr
'''


@pytest.mark.timeout(120)
def test_trace_records_fsdp_all_gathers_and_reduce_scatters(shared_group):
    tr = Trace.merge(shared_group.run(notebook_function(FSDP_STEP, "step")))
    ops = {(e["rank"], e["op"]) for e in tr}
    assert {(r, op) for r in (0, 1) for op in ("all_gather", "reduce_scatter")} <= ops
    gathered = {e["bytes"] for e in tr if e["op"] == "all_gather"}
    assert (32 * 32 + 32) * 4 in gathered  # the first layer's full parameters


@pytest.mark.timeout(60)
def test_trace_without_shapes_has_no_bytes(shared_group):
    def traced():
        import torch
        import torch.distributed as dist

        with bench.trace(shapes=False) as tr:
            dist.all_reduce(torch.ones(100))
        return tr

    tr = Trace.merge(shared_group.run(traced))
    assert [(e["rank"], e["op"], e["bytes"], e["dtype"]) for e in sorted(
        tr, key=lambda e: e["rank"])] == [(0, "all_reduce", None, None),
                                          (1, "all_reduce", None, None)]


@pytest.mark.timeout(180)
def test_cli_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "results.json", tmp_path / "bench.png"
    rc = bench.cli(["--world-size", "2", "--backend", "gloo", "--ops", "all_reduce,barrier",
                    "--sizes", "4K-8K", "--iters", "2", "--warmup", "1", "--out", str(out),
                    "--plot", str(png), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split()[:4] == ["op", "size", "(KiB)", "world_size"]
    assert text.splitlines()[2].split()[:2] == ["all_reduce", "4"]  # 4 KiB, in the header's unit
    assert "memcpy (one core):" in text and f"records written to {out}" in text
    records = Records.from_json(out)
    assert [(r["op"], r["bytes"]) for r in records] == [("all_reduce", 4096),
                                                        ("all_reduce", 8192), ("barrier", 0)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv_out = tmp_path / "r.csv"
    assert bench.cli(["-n", "1", "--ops", "barrier", "--iters", "1", "--out", str(csv_out),
                      "--no-progress"]) == 0
    assert Records.from_csv(csv_out)[0]["op"] == "barrier"


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "64M-4K"], "the size range '64M-4K' goes down"),
    (["--sizes", "-4K"], "a size must be a positive number of bytes, got '-4K'"),  # not an option
    (["--ops", "allreduce"], "unknown op 'allreduce'; valid ops"),
    (["--dtype", "complex64"], "dtype must be a real floating-point or integer torch dtype"),
    (["--out", "r.txt"], "--out must name a .json or .csv file, got 'r.txt'"),
])
@pytest.mark.timeout(30)
def test_cli_usage_mistakes(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.cli(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_cli_without_matplotlib_or_backend(capsys, monkeypatch):
    assert bench.cli(["--backend", "nccl", "--device", "cpu", "--no-progress"]) == 1
    assert capsys.readouterr().err.startswith("nbdist bench: ")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit):
        bench.cli(["--plot", "x.png"])
    assert "--plot needs matplotlib (pip install matplotlib)" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_python_m_nbdist_bench_dispatches(capsys):
    from nbdist.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0 and "--sizes" in capsys.readouterr().out
