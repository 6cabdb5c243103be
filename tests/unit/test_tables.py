"""Tables people read (nbdist.report.table): one unit per column, in its header, in HTML and text;
the benchmark and memory tables built on it; exports that keep raw SI values."""
import csv
import io
import json
import re

import pytest

from nbdist import bench, memory
from nbdist.bench import Records, Table, Trace
from nbdist.memory import MemoryRecord, MemoryReport
from nbdist.report.table import KINDS, Column, TableView

pytestmark = pytest.mark.timeout(30)

META = dict(dtype="float32", world_size=2, backend="gloo", device="cpu", iters=3, warmup=1)


def _sweep():
    """all_reduce at 4 KiB and 64 MiB: times from 12 µs to 31 ms, rates from 0.3 to 2 GB/s."""
    def point(nbytes, t):
        return bench.summarize("all_reduce", [{"status": "ok", "bytes": nbytes, "count": nbytes // 4,
                                               "times": [t] * 3, "verified": True,
                                               "note": None}] * 2, **META)
    return Records([point(4 << 10, 1.2e-5), point(64 << 20, 3.1e-2)])


def _html_table(markup):
    """(headers, rows of cells) of the one <table> in ``markup``."""
    heads = re.findall(r"<th(?: [^>]*)?>(.*?)</th>", markup)
    rows = [re.findall(r"<td(?: [^>]*)?>(.*?)</td>", tr) for tr in
            re.findall(r"<tr>(.*?)</tr>", markup.split("<tbody>")[1])]
    return heads, rows


def _text_table(text):
    """(header line, data lines) of a text table: the line after the header is its rule."""
    lines = text.splitlines()
    assert set(lines[1]) == {"-"} and len(lines[1]) == len(lines[0])
    return lines[0], lines[2:]


# ---- the renderer -------------------------------------------------------------------------
def test_a_column_of_4_KiB_and_64_MiB_is_in_one_unit():
    view = TableView([{"bytes": 4 << 10}, {"bytes": 64 << 20}], ["bytes"])
    assert view.headers() == ["size (KiB)"] and view.cells() == [["4"], ["65536"]]
    heads, rows = _html_table(view._repr_html_())
    assert heads == ["size (KiB)"] and rows == [["4"], ["65536"]]


@pytest.mark.parametrize("kind,values,header,cells", [
    ("time", [1.2e-5, 3.1e-3], "t (µs)", ["12", "3100"]),
    ("time", [1.25e-5, 3.1e-3], "t (µs)", ["12.5", "3100.0"]),
    ("time", [2.0, 0.5], "t (ms)", ["2000", "500"]),
    ("time", [0, None], "t (s)", ["0", "-"]),
    ("bytes", [1536, 3 << 20], "t (KiB)", ["1.50", "3072.00"]),
    ("bytes_si", [31.4e9, 1.875e9], "t (GB)", ["31.40", "1.88"]),
    ("rate", [0.0123, 5.4321], "t (GB/s)", ["0.012", "5.432"]),
    ("fraction", [0.3, 0.05], "t (%)", ["30", "5"]),
    ("number", [1, 0.5], "t", ["1.000", "0.500"]),
    ("number", [3, 12], "t", ["3", "12"]),
    ("text", ["a", None], "t", ["a", "-"]),
])
def test_every_number_of_a_column_is_in_the_headers_unit(kind, values, header, cells):
    view = TableView([{"t": v} for v in values], [Column("t", kind=kind)])
    assert view.headers() == [header] and [c for (c,) in view.cells()] == cells


def test_a_group_of_columns_shares_one_unit_and_decimals_can_be_fixed():
    rows = [{"a": 2e-3, "b": 5e-6, "c": 0.123}]
    view = TableView(rows, [Column("a", kind="time", group="t"), Column("b", kind="time", group="t"),
                            Column("c", kind="fraction", decimals=1, signed=True)])
    assert view.headers() == ["a (µs)", "b (µs)", "c (%)"]
    assert view.cells() == [["2000", "5", "+12.3"]]


def test_text_aligns_numbers_right_and_text_left_with_notes_under_it():
    view = TableView([{"op": "all_reduce", "time_s": 1.2e-5}, {"op": "barrier", "time_s": 3.1e-3}],
                     ["op", "time_s"], notes=["barrier: a note"])
    text = str(view)
    assert text == repr(view) == view.text()
    header, lines = _text_table(text)
    assert header == "op          time (µs)"
    assert lines == ["all_reduce         12", "barrier          3100", "barrier: a note"]
    assert len({len(line) for line in lines[:2]} | {len(header)}) == 1  # columns line up


def test_html_escapes_cells_and_notes_and_aligns_by_kind():
    view = TableView([{"name": "<b>&", "n": 3}], ["name", "n"], notes=["x < y"])
    markup = view._repr_html_()
    assert markup.startswith("<table><caption") and "<b>" not in markup
    assert "&lt;b&gt;&amp;" in markup and "x &lt; y" in markup
    assert "<th style='text-align:left'>name</th>" in markup
    assert "<td style='text-align:right'>3</td>" in markup


def test_ipython_shows_the_text_and_the_html():
    from IPython.core.formatters import DisplayFormatter

    view = TableView([{"bytes": 4096}], ["bytes"])
    data, _ = DisplayFormatter().format(view)
    assert data["text/plain"] == str(view) and "size (KiB)" in data["text/html"]


def test_columns_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"unknown column kind 'seconds' for 't'; valid kinds: "
                                         r"time, bytes"):
        Column("t", kind="seconds")
    assert set(KINDS) >= {"time", "bytes", "bytes_si", "rate", "fraction", "number", "text"}
    assert Column.for_key("busbw_GBps") == Column("busbw_GBps", "busbw", "rate")
    assert Column.for_key("params_bytes") == Column("params_bytes", "params", "bytes")
    assert Column.for_key("_s") == Column("_s")


# ---- benchmark tables ---------------------------------------------------------------------
def test_sweep_table_has_one_unit_per_column_in_html_and_text():
    records = _sweep()
    heads, rows = _html_table(records._repr_html_())
    assert heads == ["op", "size (KiB)", "world_size", "backend", "median (µs)", "p10 (µs)",
                     "p90 (µs)", "algbw (GB/s)", "busbw (GB/s)", "spiked (%)", "noisy", "status"]
    assert [r[1] for r in rows] == ["4", "65536"]
    assert [r[4] for r in rows] == ["12", "31000"]  # not "12 µs" and "31 ms"
    assert [r[8] for r in rows] == ["0.341", "2.165"]  # 4096 B / 12 µs, times 2 (n - 1) / n
    header, lines = _text_table(str(records))
    lines, notes = lines[:len(records)], lines[len(records):]  # the notes follow the rows
    assert notes == ["median (p10, p90) of 3 iterations, slowest rank; algbw = size / median",
                     "spiked: the iterations slower than 2 x p10; from half of them, the median "
                     "is one of those",
                     "status: ok (the result was checked), unsupported (the backend lacks the op) "
                     "or wrong (the check failed)"]
    assert [r[9] for r in rows] == ["0", "0"]  # no iteration spiked
    assert header.startswith("op          size (KiB)  world_size  backend  median (µs)")
    assert "µs" not in "".join(lines) and "GB/s" not in "".join(lines)
    assert len({len(line) for line in lines}) == 1


def test_sweep_notes_describe_only_the_columns_shown():
    """Tutorial 02 shows median and busbw only: its note named p10, p90 and algbw, columns a
    reader could not find (issue 35's review)."""
    records = _sweep()
    _, lines = _text_table(records.format(["backend", "bytes", "time_s", "busbw_GBps"]))
    assert lines[len(records):] == [
        "median of 3 iterations, slowest rank; busbw = size / median x the op's bus factor"]
    _, lines = _text_table(records.format(["op", "time_s", "p10_s", "p90_s"]))
    assert lines[len(records):] == ["median (p10, p90) of 3 iterations, slowest rank"]


def test_sweep_exports_stay_raw_si():
    records = _sweep()
    rows = list(csv.DictReader(io.StringIO(records.to_csv())))
    assert float(rows[0]["time_s"]) == 1.2e-5 and int(rows[1]["bytes"]) == 64 << 20
    assert float(rows[0]["busbw_GBps"]) == pytest.approx(4096 / 1.2e-5 / 1e9)
    assert json.loads(records.to_json())[1]["mean_s"] == pytest.approx(3.1e-2)
    assert Records.from_csv(io.StringIO(records.to_csv())) == records


def test_unsupported_ops_are_explained_under_the_table():
    row = dict(_sweep()[0], status="unsupported", note="gloo has no all_to_all", op="all_to_all")
    records = Records([row, dict(row)])
    assert str(records).splitlines()[-1] == "all_to_all: gloo has no all_to_all"
    assert "<caption" in records._repr_html_()


def test_trace_summary_and_plain_tables():
    tr = Trace([{"rank": 0, "op": "all_reduce", "bytes": 4096, "dtype": "float32", "start": 1.0,
                 "duration": 2e-3, "issued": 1.0},
                {"rank": 0, "op": "barrier", "bytes": None, "dtype": None, "start": 1.5,
                 "duration": 5e-5, "issued": 1.5}], {0: (1.0, 2.0)})
    heads, rows = _html_table(tr.summary()._repr_html_())
    # time and mean in one unit, the longest's; sizes in the largest op's unit (issue 35: two
    # traces of tutorial 03 read "size (B)" and "size (KiB)", one "time (ms)" next to "mean (µs)")
    assert heads == ["op", "calls", "size (KiB)", "time (ms)", "mean (ms)", "share (%)"]
    assert rows[0] == ["all_reduce", "1", "4", "2.000", "2.000", "0.2"]
    assert rows[1] == ["barrier", "1", "-", "0.050", "0.050", "0.0"]
    assert tr.summary()._notes()[0].startswith("per rank: calls, time; size: per call; time: "
                                               "from a rank's call of the op to its end")
    assert "share: the op's time over the traced block's" in tr.summary()._notes()[0]
    assert Table([{"a": 1, "b": "x"}]).format() == "a  b\n----\n1  x"


# ---- memory tables ------------------------------------------------------------------------
def _record(strategy, rank, params, **kw):
    base = dict(world_size=2, device="cpu", num_params=params // 4, params=params, grads=params,
                optimizer=2 * params, other=1500, in_flight=0, peak=None, rss=412_000_000,
                rss_base=300_000_000, accuracy={"params": "exact"}, estimate=4 * params,
                formula="ZeRO-0")
    base.update(kw)
    return MemoryRecord(strategy, rank, **base)


def _report():
    return MemoryReport([_record("ddp", 0, 4_000_000), _record("ddp", 1, 4_000_000),
                         _record("fsdp", 0, 2_000_000, estimate=7_900_000,
                                 notes=["fsdp & friends"]),
                         _record("fsdp", 1, 2_000_000)])


def test_memory_table_has_units_in_headers_and_one_unit_per_column():
    report = _report()
    heads, rows = _html_table(report._repr_html_())
    # every size in the model state's unit (issue 35: "other (B)" read 263177 next to KiB)
    assert heads == ["strategy", "rank", "params (MiB)", "grads (MiB)", "optim (MiB)",
                     "state (MiB)", "estimate (MiB)", "diff (%)", "other (MiB)", "in-flight (MiB)"]
    # a group: one unit and one number of decimals for all five
    assert rows[0][2:8] == ["3.81", "3.81", "7.63", "15.26", "15.26", "+0.0"]
    assert rows[1][2:8] == ["1.91", "1.91", "3.81", "7.63", "7.53", "+1.3"]
    assert rows[0][8:] == ["0.001", "0"]  # 1500 B: as small as it is, not in another unit
    assert [r[:2] for r in rows] == [["ddp", "0-1"], ["fsdp", "0"], ["fsdp", "1"]]
    markup = report._repr_html_()
    assert "fsdp rank 0: fsdp &amp; friends" in markup
    header, lines = _text_table(report.table())
    assert header.startswith("strategy  rank  params (MiB)")
    assert lines[3] == "fsdp rank 0: fsdp & friends" and lines[4].startswith("peak: not measured")
    assert lines[5].startswith("rss (process memory, not in the table): 393 MiB per rank, of "
                               "which 286 MiB before the model was built")
    assert repr(report).startswith("<MemoryReport: 4 records>\n" + header)
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(report)
    assert data["text/plain"] == repr(report) and "params (MiB)" in data["text/html"]


def test_ranks_with_equal_figures_share_one_row():
    """Issue 35: notebook 10's table repeated each strategy's row once per rank (4 x 4 rows);
    ranks that differ in any shown figure keep their own rows, the exports keep every rank."""
    recs = [_record("tp", r, 4096) for r in range(4)]
    recs += [_record("pp", r, 4096, other=1024 * (2 if r in (0, 3) else 4)) for r in range(4)]
    recs += [_record("ddp", r, 4096) for r in (0, 2)]
    report = MemoryReport(recs)
    ranks = [(row[0], row[1]) for row in report._view().cells()]
    assert ranks == [("tp", "0-3"), ("pp", "0"), ("pp", "1-2"), ("pp", "3"), ("ddp", "0, 2")]
    assert len(report.to_dicts()) == 10 and report.to_dicts()[1]["rank"] == 1


def test_the_memory_plot_reads_in_the_tables_unit():
    """Issue 35: tutorial 09's table was in KiB, its figure in MiB; and its names broke at "_"."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    names = ("zero1", "fairscale_oss", "deepspeed_zero1", "fsdp_grad_op", "fairscale_sharded")
    report = MemoryReport([_record(n, r, 3 << 20, other=4 if r else 263177) for n in names
                           for r in (0, 1)])
    ax = report.plot()
    unit = report._view().headers()[2].split("(")[1].rstrip(")")
    assert ax.get_ylabel() == f"bytes per rank ({unit})" and unit == "MiB"
    assert [t.get_text() for t in ax.get_xticklabels()] == list(names)
    assert ax.get_xlabel() == "one bar per rank (ranks 0-1)"
    import matplotlib.pyplot as plt
    plt.close(ax.figure)


def test_the_notes_give_sizes_in_the_tables_unit():
    """Issue 35: tutorial 09's table was in KiB, its notes said "1.027 MiB"; RSS (a process
    figure, coarse) and sizes under one unit keep theirs."""
    recs = [_record("fsdp_grad_op", r, 3 << 18, notes=[
        "ZeRO-2's full parameters: 1.027 MiB in flight (ZeRO-2 counts 1.004 MiB); scalar (4 B), "
        "bucket 257 KiB"]) for r in (0, 1)]
    view = MemoryReport(recs)._view()
    assert view.headers()[2] == "params (KiB)"
    assert view.notes[0] == ("fsdp_grad_op: ZeRO-2's full parameters: 1052 KiB in flight "
                             "(ZeRO-2 counts 1028 KiB); scalar (4 B), bucket 257 KiB")
    assert view.notes[-1].startswith("rss (process memory, not in the table): 393 MiB")


def test_a_column_in_a_fixed_unit():
    view = TableView([{"b": 4}, {"b": 263177}], [Column("b", "other", "bytes", unit="KiB")])
    assert view.headers() == ["other (KiB)"] and view.cells() == [["0.004"], ["257.009"]]
    with pytest.raises(ValueError, match=r"column 'b' of kind 'bytes' cannot be shown in 'ms'; "
                                         r"its units: TiB, GiB, MiB, KiB, B"):
        Column("b", kind="bytes", unit="ms")


def test_one_quantity_reads_the_same_in_every_column_of_its_group():
    # notebook 10's traffic table showed 18.52 and 18.5 for one size, and a ratio as "1"
    rows = [{"a": 18.52 * 1024, "b": 18.5 * 1024, "r": 1.0}, {"a": 9.26 * 1024, "b": 18.5 * 1024,
                                                              "r": 1.0}]
    view = TableView(rows, [Column("a", kind="bytes", group="s"),
                            Column("b", kind="bytes", group="s"), Column("r", decimals=3)])
    assert view.headers() == ["a (KiB)", "b (KiB)", "r"]
    assert view.cells() == [["18.52", "18.50", "1.000"], ["9.26", "18.50", "1.000"]]


def test_a_ratio_column_has_one_number_of_decimals():
    view = TableView([{"r": 1}, {"r": 18.5}, {"r": 0.46}], [Column("r", "vs torch")])
    assert [c for (c,) in view.cells()] == ["1.000", "18.500", "0.460"]


def test_a_note_is_kept_once():
    view = TableView([{"a": 1}], ["a"], notes=["x", "y", "x"])
    assert view.notes == ["x", "y"] and str(view).splitlines()[-2:] == ["x", "y"]


def test_memory_notes_shared_by_ranks_and_strategies_are_written_once():
    same = "DeepSpeed keeps an fp32 master copy"
    recs = [_record(s, r, 1000, notes=[same, f"rank note {r}"] if s != "ddp" else [])
            for s in ("ddp", "deepspeed_zero1", "deepspeed_zero2") for r in (0, 1)]
    notes = MemoryReport(recs)._view().notes
    assert notes[:3] == [f"deepspeed_zero1, deepspeed_zero2: {same}",
                         "deepspeed_zero1 rank 0, deepspeed_zero2 rank 0: rank note 0",
                         "deepspeed_zero1 rank 1, deepspeed_zero2 rank 1: rank note 1"]


def test_a_measured_peak_is_a_column_and_rss_a_note():
    recs = [_record("ddp", r, 4 << 20, peak=(20 << 20) + r, rss=(400 << 20) + r * (5 << 20))
            for r in (0, 1)]
    view = MemoryReport(recs)._view()
    assert view.headers()[-1] == "peak (MiB)" and view.cells()[0][-1] == "20.0"
    assert not any(n.startswith("peak:") for n in view.notes)
    assert view.notes[-1].startswith("rss (process memory, not in the table): 400 to 405 MiB "
                                     "per rank")


def test_memory_exports_keep_bytes():
    report = _report()
    assert report.to_dicts()[0]["params"] == 4_000_000 and report.to_dicts()[0]["diff"] == 0
    rows = list(csv.DictReader(io.StringIO(report.to_csv())))
    assert rows[0]["params_bytes"] == "4000000" and rows[0]["rss_bytes"] == "412000000"
    assert rows[0]["peak_bytes"] == "" and rows[2]["notes"] == "fsdp & friends"
    assert "params" not in rows[0]  # every size names its unit
    pd = pytest.importorskip("pandas")
    frame = report.to_pandas()
    assert isinstance(frame, pd.DataFrame) and frame["model_state_bytes"].tolist()[0] == 16_000_000


def test_memory_csv_to_a_file(tmp_path):
    _report().to_csv(tmp_path / "m.csv")
    assert (tmp_path / "m.csv").read_text().startswith("strategy,rank,world_size")
    buf = io.StringIO()
    assert _report().to_csv(buf) is None and buf.getvalue().startswith("strategy,")


def test_estimate_table_text_and_html():
    table = memory.estimate_table("7.5B", 64, ["ddp", "zero1", "fsdp"], "bf16-mixed")
    text = str(table)
    header, lines = _text_table(text)
    assert header.startswith("strategy  stage") and header.endswith("per rank (MiB)")
    assert lines[0].split()[-1] == "114441" and lines[1].split()[-1] == "29951"
    assert lines[2].split()[-1] == "1788"
    assert lines[3].startswith("ddp: plain DP: 2Ψ + 2Ψ + 12Ψ = 16Ψ")
    heads, rows = _html_table(table._repr_html_())
    assert heads == ["strategy", "stage", "params (MiB)", "grads (MiB)", "optimizer (MiB)",
                     "per rank (MiB)"]
    assert rows[2] == ["fsdp", "ZeRO-3", "224", "224", "1341", "1788"]
    assert "Ψ=7,500,000,000, N=64" in table._repr_html_()
