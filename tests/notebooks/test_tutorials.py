"""Every tutorial notebook runs top to bottom in a real kernel (nbclient); key outputs are checked.
Notebooks are stored without outputs."""
import os
import pathlib
import re

import nbformat
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
pytestmark = pytest.mark.timeout(300)


def _text(cell):
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
        elif out.get("output_type") == "error":
            parts.append("\n".join(out["traceback"]))
    return "".join(parts)


def run_notebook(name, runs):
    """The tutorial as the session executed it (``tutorial_runs``, tests/conftest.py), and the text
    of each code cell's outputs."""
    nb = runs(name)
    stderr = [o["text"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    assert not [t for t in stderr if "nbdist: torch uses" in t], \
        "an informational note went to stderr, which Jupyter shows as an error"
    return nb, [_text(c) for c in nb.cells if c.cell_type == "code"]


def _stderr(nb):
    """Everything the notebook's cells wrote to stderr, which Jupyter shows as an error."""
    return "".join(o["text"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stderr")


def _widget_pngs(nb):
    """How many PNG images the notebook's widgets hold (the panels' figures, in the saved state)."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return sum(m.get("model_name") == "ImageModel" and buf.get("path") == ["value"]
               and bool(buf["data"])
               for m in state.get("state", {}).values() for buf in m.get("buffers", []))


@pytest.mark.parametrize("path", sorted(NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


def test_quickstart(tutorial_runs):
    """all_reduce sums over the ranks, all_gather concatenates in rank order, an error on one
    rank names that rank only and the group stays usable."""
    nb, out = run_notebook("01_quickstart.ipynb", tutorial_runs)
    text = "\n".join(out)
    assert "[rank 0] before all_reduce: [1.0, 1.0, 1.0]" in out[2]
    assert "[rank 1] before all_reduce: [2.0, 2.0, 2.0]" in out[2]
    assert "Out[rank 0]: tensor([3., 3., 3.])" in out[2]  # 1 + 2 on every rank
    assert "Out[rank 1]: tensor([3., 3., 3.])" in out[2]
    gathered = "[0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]"  # rank 0's chunk, then rank 1's
    assert f"Out[rank 0]: {gathered}" in out[3] and f"Out[rank 1]: {gathered}" in out[3]
    assert "[0, 1]" in out[4] and "[0.1, 0.2]" in out[5]
    assert "[tensor([3., 3., 3.]), tensor([3., 3., 3.])]" in out[6]  # one per rank, in order
    assert "--- rank 1 ---" in out[7] and "ValueError: something went wrong on rank 1" in out[7]
    assert "--- rank 0 ---" not in out[7]
    assert "Out[rank 0]" not in out[7]  # a failing cell shows no values, as the text says
    assert out[8].strip() == "['fine', None]"  # rank 0's value, kept in the error
    assert "still here on rank 0" in out[9] and "still here on rank 1" in out[9]
    status = {line.split()[0]: line for line in out[10].splitlines()[2:]}
    assert "ValueError" in status["1"] and "ValueError" not in status["0"], out[10]
    assert "group stopped" in text and not _stderr(nb)


def test_backends(tutorial_runs):
    """auto picks gloo on CPU, bad backends are refused before a process starts, a custom
    backend and nbdist_shm reduce correctly; the speed comparison prints its evidence (the
    load, one unit per column, the ratios). Which backend is faster is not asserted: on a shared
    2-core machine the ratio at 4 MiB has come out at 0.17 and at 1.41."""
    nb, out = run_notebook("02_backends.ipynb", tutorial_runs)
    assert "+ gloo       available" in out[0] and "+ nbdist_shm available" in out[0]
    assert "auto picks gloo for cpu" in out[0]
    assert "nccl: backend 'nccl' cannot be used" in out[1] and "use backend='gloo'" in out[1]
    assert "unknown backend 'nope'" in out[1]
    assert "('nbstore', [3.0, 3.0, 3.0])" in out[2] and "['gloo', 'gloo']" in out[3]
    assert "('nbdist_shm', [3.0, 3.0, 3.0, 3.0])" in out[4]
    bench = out[5]
    assert bench.startswith("load average (1 min): ") and "memcpy, 64 MiB on one core:" in bench
    header = bench.splitlines()[1]  # one unit per column, in its header
    assert "size (" in header and "median (" in header and "busbw (GB/s)" in header, bench
    # the note under it speaks of these columns only (issue 35: p10, p90, algbw named, not shown)
    assert "median of 50 iterations, slowest rank; busbw = size / median" in bench, bench
    assert "p10" not in bench and "algbw" not in bench, bench
    # the slower backend's time as a multiple of the faster's, never a ratio rounded to 0.00x (CI:
    # gloo's 4 KiB median was a 3.2 ms spike against nbdist_shm's 16 us)
    ratios = {m[1]: float(m[2] or m[3]) for m in re.finditer(
        r"^(4 KiB|4 MiB): (?:nbdist_shm takes ([0-9.]+)x gloo|gloo takes ([0-9.]+)x nbdist_shm)'s "
        r"time$", bench, re.M)}
    assert set(ratios) == {"4 KiB", "4 MiB"} and all(r >= 1 for r in ratios.values()), bench
    assert not _stderr(nb)


def test_failures(tutorial_runs):
    """Each failure is reported by rank, fast, with what to do; the group comes back."""
    nb, out = run_notebook("06_failures.ipynb", tutorial_runs)
    assert "ranks [1]" in out[1] and "ZeroDivisionError on rank 1: division by zero" in out[1]
    assert "rank 1 exited with code 3." in out[2] and "call restart()" in out[2]
    # "at once, not after a collective timeout": the group's timeout is 20 s
    assert float(out[2].split("after ")[1].split(" s:")[0]) < 20, out[2]
    assert out[3].strip() == "[0, 1]"
    assert "rank 1 was killed by SIGABRT" in out[4] and "This is a collective mismatch" in out[4]
    assert "--- rank 1 stderr (last lines) ---" in out[4]
    assert "Received data size doesn't match" in _stderr(nb)  # rank 1's own abort, a real error
    # debug="detail": an ordinary error on both ranks, each rank's call named, group survives
    assert "Mismatched collectives: rank 0 failed in all_reduce #1 (1000 float32); rank 1 " \
           "failed in all_reduce #1 (500 float32)." in out[5], out[5]
    assert "it made a small training step 2.4x slower" in out[5]  # "the note says how much"
    assert out[5].rstrip().endswith("ready [0, 1]"), out[5]
    assert "ranks 0, 1 still running after 2 s; rank 1 stopped on SIGINT; rank 0 did not react" \
        in out[6] and "rank 1 never reached collective #1" in out[6]
    assert out[6].rstrip().endswith("broken")
    assert "interrupted ranks 0, 1; stopped on SIGINT; the group is still usable." in out[7]
    assert "['usable again', 'usable again']" in out[7]
    # auto_restart: the error says the next call restarts, and it does
    assert "rank 1 exited with code 3.\nThe group was shut down; it restarts on the next call " \
           "(auto_restart; per-rank variables are lost)." in out[8], out[8]
    assert out[8].rstrip().endswith("broken -> [0, 1] -> ready"), out[8]


def test_widgets(tutorial_runs):
    """The panels drive the public API on the current group: the launcher's group is the one
    code uses (with its strategy on the ranks), and Run measures and draws."""
    nb, out = run_notebook("07_widgets.ipynb", tutorial_runs)
    assert "['gloo', 'nbdist_shm', 'nbstore']" in out[0]
    assert "rank 0: backend gloo, strategy ddp" in out[2] and "rank 1: backend gloo" in out[2]
    assert "14 points on gloo, 2 ranks" in out[3]  # 2 ops x 7 sizes from 4 KiB to 256 KiB
    assert "measured 3 strategies on 2 ranks" in out[4]
    assert _widget_pngs(nb) >= 3  # the benchmark's figure, the memory bars, the estimate curve
    # a page without the widgets shows each panel's own text and HTML, not a repr of children
    views = [o["data"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 5, len(views)  # launcher, bench, memory twice, mesh
    assert all(v["text/plain"].startswith("nbdist ") and "children=" not in v["text/plain"]
               and "need a running kernel" in v["text/html"] for v in views), views
    assert "<img src='data:image/png;base64," in views[1]["text/html"]  # the bench figure
    assert not _stderr(nb)


_UNITS = {"ns": 1e-9, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20,
          "GiB": 1 << 30, "MB/s": 1e-3, "GB/s": 1.0, "%": 0.01}


def _rate(text):
    """GB/s from a printed rate: '12.3 MB/s' -> 0.0123."""
    value, unit = text.split()
    return float(value) * _UNITS[unit]


def _sweep_rows(text):
    """The rows of a Records table as printed (text/plain), in SI units: seconds, bytes, GB/s."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("op "))
    heads = re.split(" {2,}", lines[start].strip())
    names = [h.split(" (")[0] for h in heads]
    scale = {n: _UNITS[h[h.index("(") + 1:-1]] if "(" in h else None for n, h in zip(names, heads)}
    rows = []
    for line in lines[start + 2:]:
        cells = line.split()
        if len(cells) != len(heads):
            break
        rows.append({n: (float(c) * scale[n] if scale[n] and c != "-" else c)
                     for n, c in zip(names, cells)})
    return heads, rows, lines[start + 2 + len(rows):]


def test_collectives(tutorial_runs):
    nb, out = run_notebook("03_collectives.ipynb", tutorial_runs)
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(out)
    # One statistic throughout: the table's bandwidth is its size / its median time.
    heads, rows, notes = _sweep_rows(out[1])
    assert [h.split(" (")[0] for h in heads][4:] == ["median", "p10", "p90", "algbw", "busbw",
                                                     "spiked", "noisy", "status"]
    assert len(rows) == 3 * 11 + 1 and "median (p10, p90) of 50 iterations" in "".join(notes)
    for r in rows:
        if r["op"] != "barrier":
            assert r["algbw"] == pytest.approx(r["size"] / r["median"] / 1e9, rel=0.02, abs=2e-3)
        if r["p90"] > 2.05 * r["p10"] or r["p90"] < 1.95 * r["p10"]:  # away from rounding
            assert r["noisy"] == ("yes" if r["p90"] > 2 * r["p10"] else "no"), r
    assert ("noisy: p90 > 2 x p10" in "".join(notes)) == any(r["noisy"] == "yes" for r in rows)
    # The evidence printed next to the claims.
    assert re.search(r"noisy points: \d+ of 34", out[2]) and "load average" in out[2]
    check = re.search(r"= ([\d.]+ [MG]B/s); the table's algbw: ([\d.]+ [MG]B/s)", out[2])
    assert check and _rate(check[1]) == pytest.approx(_rate(check[2]), rel=0.02)
    ways = dict(re.findall(r"(memmove|torch copy_|numpy.copyto) ([\d.]+ [MG]B/s)", out[3]))
    limit = re.search(r"limit: ([\d.]+ [MG]B/s)", out[3])[1]
    assert len(ways) == 3 and _rate(limit) == max(map(_rate, ways.values()))
    assert re.search(r"best busbw: .* of memcpy", out[3])
    # the spikes: what the text says of the median is printed from the records
    shares = re.search(r"iterations that spiked, per point: (\d+)% to (\d+)% \(median (\d+)%\)",
                       out[2])
    assert shares and int(shares[1]) <= int(shares[3]) <= int(shares[2]), out[2]
    lost = int(re.search(r"points whose median is a spike \(half or more spiked\): (\d+)",
                         out[2])[1])
    assert lost == sum(r["spiked"] >= 0.5 for r in rows), out[2]  # the table's column
    assert (lost > 0) == (int(shares[2]) >= 50), out[2]
    # 2 against 3 ranks: busbw = algbw x 2(n-1)/n, so compare times, in one unit; p10 first
    table = re.findall(r"^ *(\S+ \S+) +([23]) +([\d.]+) +([\d.]+) +([\d.]+) +(\d+)% +"
                       r"([\d.]+ [MG]B/s) +([\d.]+) +([\d.]+ [MG]B/s)$", out[4], re.M)
    assert len(table) == 10 and "p10 (ms)" in out[4] and "µs" not in out[4], out[4]
    for _, n, p10, median, p90, _, algbw, factor, busbw in table:
        assert float(p10) <= float(median) <= float(p90)
        assert float(factor) == pytest.approx(2 * (int(n) - 1) / int(n), abs=0.005)
        assert _rate(busbw) == pytest.approx(_rate(algbw) * float(factor), rel=0.03)
    verdicts = re.findall(r"3 ranks / 2 ranks: p10 ([\d.]+)x, median ([\d.]+)x.*; higher busbw: "
                          r"[23] ranks", out[4])
    assert len(verdicts) == 5, out[4]
    # the lesson's claim: at p10, 3 ranks on fewer cores than that are slower at every size
    if (os.cpu_count() or 1) < 3:
        assert all(float(p10) > 1 for p10, _ in verdicts), out[4]
        assert "3 ranks were slower at p10 at 5 of 5 sizes" in out[4], out[4]
    assert not [o for o in code[4].outputs if o.get("output_type") == "execute_result"
                and "image/png" not in o.get("data", {})]  # no stray Out[] list (issue 35)
    # the two traces: one unit for the size column, share defined under the table, and the
    # broadcast the text explains: DDP's bucket order, two small ones at the second step
    for summary in (out[6], out[7]):
        assert re.search(r"^op +calls +size \(KiB\) +time \((\w+)\) +mean \(\1\)", summary,
                         re.M), summary
        assert "share: the op's time over the traced block's" in summary
    ops = {line.split()[0]: line.split() for line in out[6].splitlines()
           if line.split() and line.split()[0] in ("all_reduce", "broadcast")}
    assert ops["all_reduce"][1] == "2" and ops["broadcast"][1] == "2", out[6]
    assert float(ops["broadcast"][2]) < 1, out[6]  # KiB: a few bytes each
    # every rate in GB/s, as the tables (issue 35: "688 MB/s" under a GB/s column)
    assert "MB/s" not in text
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                 for o in c.outputs)
    assert images >= 4  # sweep, comparison, trace timeline, %%dist --trace timeline


def columns(text):
    """The table in ``text`` (a header, a rule of dashes, rows) as {header: [cells]}; checks that
    each size column names one binary unit in its header and writes every cell as a bare number
    with the same decimals."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if line and set(line) == {"-"})
    headers = re.split(r"\s{2,}", lines[rule - 1].strip())
    rows = []
    for line in lines[rule + 1:]:
        if len(line.split()) != len(headers) or ":" in line:
            break  # the notes under the table
        rows.append(line.split())
    table = {h: [r[i] for r in rows] for i, h in enumerate(headers)}
    for head, cells in table.items():
        unit = re.search(r"\((\w+)\)$", head)
        if unit and unit.group(1).endswith("B"):
            assert unit.group(1) in ("B", "KiB", "MiB", "GiB"), f"{head}: not a binary unit"
        if unit:
            shown = [c for c in cells if c != "-"]
            assert all(re.fullmatch(r"[+-]?\d+(\.\d+)?", c) for c in shown), (head, cells)
            assert len({len(c.partition(".")[2]) for c in shown}) <= 1, (head, cells)
    return table


def notes(text):
    """The lines under a table: each once."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if line and set(line) == {"-"})
    under = [line for line in lines[rule + 1:] if ":" in line]
    assert len(under) == len(set(under)), under
    return under


def test_memory(tutorial_runs):
    nb, out = run_notebook("04_memory.ipynb", tutorial_runs)
    text = "\n".join(out)
    for name in ("ddp", "zero1", "fsdp_grad_op", "fsdp2", "fairscale_oss", "fairscale_sharded"):
        assert name in text
    table = columns(out[1])
    assert "peak (B)" not in table and not any(h.startswith("rss") for h in table)
    state = dict(zip(table["strategy"], (float(v) for v in table["state (MiB)"])))
    params = dict(zip(table["strategy"], (float(v) for v in table["params (MiB)"])))
    flight = dict(zip(table["strategy"], (float(v) for v in table["in-flight (MiB)"])))
    # the lesson: each ZeRO stage holds less per rank; SHARD_GRAD_OP's full parameters in flight
    assert state["ddp"] > state["zero1"] > state["fsdp"] == state["fsdp2"] == state["fsdp_grad_op"]
    assert flight["fsdp_grad_op"] > params["ddp"] > flight["ddp"]  # every size in one unit
    under = notes(out[1])
    assert any(re.match(r"fsdp2: other: DeviceMesh(\.\w+)? \(8 B\)", n) for n in under), under
    assert any(n.startswith("peak: not measured on CPU") for n in under)
    assert any(n.startswith("rss (process memory, not in the table)") for n in under)
    # the text's in-flight figure is the table's: 0.047 MiB, three 8 x 512 fp32 tensors
    assert flight["ddp"] == round(3 * 8 * 512 * 4 / 2**20, 3) == 0.047
    prose = "".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "0.047 MiB here, 48 KiB" in prose and "here MiB for all of them" in prose
    assert {h.rsplit("(", 1)[1] for h in table if "(" in h} == {"MiB)", "%)"}, table.keys()
    columns(out[4])
    assert out[5].count("ZeRO paper") == 1, out[5]  # the basis once, not on every line
    assert "120.0 GB" in text and "31.4 GB" in text and "16.6 GB" in text and "1.9 GB" in text


def test_lightning(tutorial_runs):
    """A Trainer runs inside the ranks on their group: the data is split between them, rank 0's
    weights come back trained, strategy and backend switch, and the guards refuse what would
    start processes or split the data silently."""
    nb, out = run_notebook("05_lightning.ipynb", tutorial_runs)
    text = "\n".join(out)
    assert "(0, 'gloo', 12" in out[3] and "(1, 'gloo', 12" in out[3]  # 3 epochs x 32/8 batches
    assert "Epoch 2/2" in out[3]  # the text explains Lightning's count from 0
    # no empty rank lines left by the progress bar's cursor codes, no SLURM hint on the ranks
    assert not [line for line in text.splitlines() if line.strip() in ("[rank 0]", "[rank 1]")]
    assert "srun" not in _stderr(nb)
    losses = {line.split(",")[1].split(":")[0].strip(): float(line.rsplit(":", 1)[1])
              for line in out[4].splitlines() if line.startswith("loss in the kernel")}
    assert losses["weights trained on the ranks"] < losses["fresh weights"], out[4]
    assert "('nbstore', 'fsdp2')" in out[5] and "(0, 'nbstore', 8)" in out[6]
    assert "Out[rank 0]: 'NbdistEnvironment'" in out[8]
    refused = out[9]
    assert "Lightning tried to start its own worker processes (strategy='ddp_spawn')" in refused
    assert "Use strategy='ddp'" in refused and "'devices': 1" in refused, refused
    assert "Use devices=2" in refused  # the message says what to use instead
    for r in (0, 1):  # both refusals on every rank
        assert f"Out[rank {r}]: ['ValueError', 'ValueError']" in refused, refused
    assert "Total params" in text and "[rank 1] Total params" not in text  # from rank 0 only
    stderr = _stderr(nb)  # Lightning's INFO lines reach stdout; its warnings may stay on stderr
    assert "GPU available" in text and "GPU available" not in stderr
    assert "fit` stopped" in text and "fit` stopped" not in stderr


def test_watch_live(tutorial_runs):
    import base64
    import re
    import struct

    nb, out = run_notebook("08_watch_live.ipynb", tutorial_runs)
    code = [c for c in nb.cells if c.cell_type == "code"]
    # the cell returned at once, showing the job; %dist_watch and %dist_wait sent that display
    # again when it ended (issue 35: "running, 0.0 s" stayed in the saved page)
    assert "<nbdist.Job job 'job': done, " in out[2] and "running" not in out[2], out[2]
    assert not [o for o in code[2].outputs if o["output_type"] == "execute_result"]
    # what the ranks printed during the job stayed under the cell that started it, only there
    assert ("[ranks 0, 1] first step done" in out[2]
            or "[rank 0] first step done" in out[2] and "[rank 1] first step done" in out[2])
    assert [i for i, text in enumerate(out) if "first step done" in text] == [2], out
    kinds = [set(o.get("data", {})) for o in code[3].outputs]
    assert any("image/png" in k for k in kinds) and any(
        "application/vnd.jupyter.widget-view+json" in k for k in kinds)
    png = next(base64.b64decode(o["data"]["image/png"]) for o in code[3].outputs
               if "image/png" in o.get("data", {}))
    assert struct.unpack(">II", png[16:24])[0] == 950  # 9.5 in at 100 dpi: a notebook column
    assert "the kernel is free: 45" in out[4] and "busy: the group is busy" in out[4]
    jobs = next(o["data"]["text/html"] for o in code[5].outputs if "text/html" in o.get("data", {}))
    assert re.search(r"<td>(none logged yet|rank 0: \d+, rank 1: \d+)</td>", jobs), jobs
    # the bar, as the saved notebook keeps it: named once, ended full at the last step
    assert re.match(r"job: 100%\|.*\| 120/120 \[", out[6]), out[6]
    assert "Out[rank 0]:" in out[6] and "Out[rank 1]:" in out[6]
    # the lesson: rank 1, the slow data loader, is the straggler; rank 0 waits for it
    summary = out[7]
    units = {re.search(column + r" \((s|ms|µs)\)", summary).group(1)
             for column in ("step", "comm", "compute", "data")}
    assert len(units) == 1, summary  # every time in one unit (issue 35: comm in µs, step in ms)
    assert "slowest data: rank 1" in summary and "straggler: rank 1 (compute" in summary
    ratio = float(re.search(r"communication, rank 0 / rank 1: ([\d.]+)x", summary).group(1))
    assert ratio > 1.5, summary  # "well over rank 1's own"; the figure says so from 1.5x


def test_zero_three_ways(tutorial_runs):
    pytest.importorskip("deepspeed")
    pytest.importorskip("fairscale")
    nb, out = run_notebook("09_zero_three_ways.ipynb", tutorial_runs)
    names = ("zero1", "fairscale_oss", "deepspeed_zero1", "fsdp_grad_op", "fairscale_sharded",
             "deepspeed_zero2", "fsdp", "deepspeed_zero3")
    assert "263,168 parameters on 2 ranks" in out[0]
    assert "all eight agree with one process within 1e-5: True" in out[2]

    def rows(text, col):
        return [line.split()[col] for line in text.splitlines() if len(line.split()) > col]
    for name in names:  # a row in the loss table, the memory report and the step-time table
        assert name in rows(out[2], 0) and name in rows(out[3], 0) and name in rows(out[6], 1)
    table = columns(out[3])  # one binary unit per column; each note once
    assert set(table["strategy"]) == set(names) and not any(h.startswith("rss") for h in table)
    under = notes(out[3])
    assert ("deepspeed_zero1, deepspeed_zero2, deepspeed_zero3: DeepSpeed keeps an fp32 master "
            "copy") in out[3]
    assert sum("master copy" in n for n in under) == 1
    assert "deepspeed_zero3: DeepSpeed's stage-3 reduce bucket" in out[3]
    assert any(n.startswith("rss (process memory, not in the table)") for n in under)
    # the step times: what the ratios reflect is printed next to them, and holds on any machine
    steps = columns(out[6])
    assert "vs torch" in steps and "wrap (s)" in steps
    calls = dict(zip(steps["strategy"], (float(c) for c in steps["calls/step"])))
    mib = dict(zip(steps["strategy"], steps["MiB/step"]))
    assert calls["fairscale_oss"] < min(calls["zero1"], calls["deepspeed_zero1"])
    assert calls["fairscale_sharded"] < min(calls["fsdp_grad_op"], calls["deepspeed_zero2"])
    assert {mib[n] for n in names if n != "fsdp"} == {"2.01"} and mib["fsdp"] == "3.01"
    # whether fewer calls went with a faster step is printed from the table, never assumed
    # (issue 35: zero1 9 calls 12.56 ms, fairscale_oss 3 calls 11.26, fsdp_grad_op 8 calls 31.58)
    step = dict(zip(steps["strategy"], (float(c) for c in steps["step (ms)"])))
    stages = re.findall(r"ZeRO-(\d): fewest calls (\w+) \((\d+)\), fastest step (\w+) "
                        r"\(([\d.]+) ms\)", out[6])
    groups = {"1": names[:3], "2": names[3:6], "3": names[6:]}
    assert [s[0] for s in stages] == ["1", "2", "3"], out[6]
    for stage, fewest, count, fastest, ms in stages:
        assert calls[fewest] == min(calls[n] for n in groups[stage]) == float(count), stages
        assert step[fastest] == min(step[n] for n in groups[stage]) == float(ms), stages
    same = sum(fewest == fastest for _, fewest, _, fastest, _ in stages)
    assert f"the fewest calls went with the fastest step at {same} of 3 stages" in out[6]
    # "the call count alone does not settle the time": the pairs that show it, from the table
    pairs = re.findall(r"^  (\w+) \((\d+) calls, ([\d.]+) ms\) against (\w+) \((\d+) calls, "
                       r"([\d.]+) ms\)", out[6], re.M)
    # the table rounds to 0.01 ms: two steps equal there may still differ (either way) unrounded
    slower = {(a, b) for names_ in groups.values() for a in names_ for b in names_
              if calls[a] < calls[b] and step[a] > step[b]}
    tied = {(a, b) for names_ in groups.values() for a in names_ for b in names_
            if calls[a] < calls[b] and step[a] == step[b]}
    listed = {(a, b) for a, _, _, b, _, _ in pairs}
    assert slower <= listed <= slower | tied, out[6]
    assert f"fewer calls, yet a slower step (same stage): {len(listed)} pairs" in out[6]
    # one unit for every size in the memory table, as the text says; the plot's axis in it
    units = {re.search(r"\((\w+)\)$", h).group(1) for h in table if re.search(r"\(\w*B\)$", h)}
    assert len(units) == 1, table.keys()
    (unit,) = units  # the notes' sizes in it too, but for the process RSS (issue 35: MiB notes)
    others = {"B", "KiB", "MiB", "GiB"} - {unit, "B"}
    assert not [n for n in under if not n.startswith("rss") and
                re.search(r"\d (%s)\b" % "|".join(others), n)], under
    kinds = [set(o.get("data", {})) for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("image/png" in k for k in kinds)  # the memory plot


def test_beyond_data_parallel(tutorial_runs):
    nb, out = run_notebook("10_beyond_data_parallel.ipynb", tutorial_runs)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "8,996 parameters on 4 ranks" in out[0]
    assert "groups along dp: [0, 2] [1, 3]" in out[1] and "groups along tp: [0, 1] [2, 3]" in out[1]
    panel = [o["data"] for o in code[2].outputs
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(panel) == 1  # the mesh panel; where the widget cannot run, what it showed:
    assert panel[0]["text/plain"] == "nbdist mesh panel (4 ranks): valid: 4 ranks = dp 2 x tp 2"
    assert "<img src='data:image/png;base64," in panel[0]["text/html"]
    assert "mesh sizes dp=3, tp=2 do not fit 4 ranks" in out[3] and "dp=2, tp=2" in out[3]
    assert "all five agree with one process within 1e-5: True" in out[5]
    for label in ("ddp", "tp", "tp + sp", "fsdp2+tp", "1f1b"):
        assert any(line.startswith(label + " ") for line in out[5].splitlines()), label
    assert "UserWarning" not in out[5] and "redistributing" not in out[5]
    memory = out[6]  # the table with the sharded/replicated split and the formulas in the notes
    assert "sharded (KiB)" in memory and "replicated (KiB)" in memory
    mem_rows = [line.split()[:2] for line in memory.split("\n-", 1)[1].splitlines()[1:]
                if len(line.split()) > 2 and re.fullmatch(r"\d+(-\d+)?", line.split()[1])]
    for name in ("ddp", "tp", "fsdp2+tp", "pp"):  # every rank once; equal ranks share a row
        ranks = [r for n, r in mem_rows if n == name]
        listed = [int(x) for r in ranks for x in (range(int(r.split("-")[0]), int(
            r.split("-")[1]) + 1) if "-" in r else [r])]
        assert sorted(listed) == [0, 1, 2, 3], (name, mem_rows)
    # replicas: the same model state on every rank (params .. replicated); the other and
    # in-flight bytes of one rank may differ on some runs (a buffer alive at that moment)
    state = {}
    for line in memory.split("\n-", 1)[1].splitlines()[1:]:
        cells = line.split()
        if len(cells) > 2 and re.fullmatch(r"\d+(-\d+)?", cells[1]):
            state.setdefault(cells[0], set()).add(tuple(cells[2:9]))
    assert len(state["ddp"]) == 1 and len(state["tp"]) == 1, memory
    assert "Ψ_s/(dp·tp) + Ψ_r/dp" in memory and "Ψ_s/tp + Ψ_r" in memory
    assert "PP: the stage's layers" in memory
    # under pp the in-flight bytes are not measured: "-" and a note, not a 0 next to the
    # timeline's microbatches held (issue 35)
    assert "in-flight under pp: not measured" in memory
    assert all(line.split()[-1] == "-" for line in memory.splitlines()
               if line.split()[:1] == ["pp"]), memory
    traffic = [line.split() for line in out[7].splitlines()]
    rows = {(r[0], r[2]): r for r in traffic if len(r) >= 10 and r[0] in ("dp", "tp")}
    assert set(rows) == {("dp", "all_gather"), ("dp", "reduce_scatter"), ("tp", "all_reduce")}
    for r in rows.values():
        assert r[3] == r[4] and r[7] == "1.000", r  # calls and bytes as the analytic figure says
    assert "sent by NCCL/rank" in out[7]
    assert "1f1b, 4 microbatches, 4 ranks, 4 stages" in out[8]
    assert "peak in flight (microbatches)" in out[8]
    assert "theory 43% = (p-1)/(m+p-1) = 3/7 (p=4, m=4)" in out[9] and "replayed" in out[9]
    assert "one gloo send of its activation" in out[9] and "4 ranks on " in out[9]
    assert any("image/png" in o.get("data", {}) for o in code[9].outputs)  # the Gantt chart
    assert any("image/png" in o.get("data", {}) for o in code[1].outputs)  # the mesh figure
    assert "cores here" in out[10]
    # the three schedules on 2 ranks: a line each, then their charts on one time axis
    printed = "".join(o["text"] for o in code[11].outputs if o.get("output_type") == "stream")
    lines = {line.split(":")[0]: line for line in printed.splitlines() if "bubble measured" in line}
    assert set(lines) == {"gpipe", "1f1b", "interleaved1f1b"}, printed
    for name in ("gpipe", "1f1b"):
        assert "theory 20% = (p-1)/(m+p-1) = 1/5 (p=2, m=4)" in lines[name]
        assert "; 8 sends a step" in lines[name]
    assert "theory 11% = (p-1)/(v*m+p-1) = 1/9 (p=2, v=2, m=4)" in lines["interleaved1f1b"]
    assert "; 24 sends a step" in lines["interleaved1f1b"]  # v*p - 1 = 3 crossings each way
    # each chart is the step its line prints (its title says so: tests/unit/test_pipeline_chart),
    # all on the scale of the longest of them (issue 35: three scales made interleaved look fast)
    steps = [int(re.search(r"; step (\d+) ms;", lines[n]).group(1)) for n in lines]
    axis = re.search(r"on one time axis \(its longest step, (\d+) ms\)", printed)
    assert axis and int(axis.group(1)) == max(steps), printed
    kinds = ["text" if o.get("output_type") == "stream" else
             "image" if "image/png" in o.get("data", {}) else "other" for o in code[11].outputs]
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert collapsed == ["text", "image"], kinds  # the lines, then one figure of three charts
    # the lesson that holds whatever the load: GPipe holds every microbatch's activations, 1F1B
    # p - rank (from the order of events alone). Which bubble is smallest is timing: on 2 cores
    # shared with other work even the replayed order of medians came out with interleaved's 1
    # point below GPipe's, so the test checks that each verdict says what its own numbers say.
    verdict = out[12]
    assert "GPipe rank 0: 4, rank 1: 4; 1F1B rank 0: 2, rank 1: 1" in verdict
    replayed = re.search(r"\(replayed\): interleaved (\d+)%, 1F1B (\d+)%, GPipe (\d+)%: "
                         r"interleaved's is (not )?the smallest", verdict)
    measured = re.search(r"measured: interleaved (\d+)%, 1F1B (\d+)%: interleaved's is (not )?",
                         verdict)
    assert replayed and measured, verdict
    inter, others = int(replayed.group(1)), (int(replayed.group(2)), int(replayed.group(3)))
    assert (replayed.group(4) is None) == (inter < min(others)) or inter == min(others), verdict
    inter, one = int(measured.group(1)), int(measured.group(2))
    assert (measured.group(3) is None) == (inter < one) or inter == one, verdict
    # what interleaving lost beyond its replay: the verdict says what its own numbers say
    extra = dict(re.findall(r"^(1F1B|interleaved): the wall-clock step took ([+-][\d.]+) ms "
                            r"against its replay; its (?:8|24) sends alone take [\d.]+ ms$",
                            verdict, re.M))
    assert set(extra) == {"1F1B", "interleaved"}, verdict
    more = re.search(r"beyond its replay, interleaved lost (more|no more) time than 1F1B here",
                     verdict)
    assert more and (more.group(1) == "more") == (float(extra["interleaved"]) >
                                                  float(extra["1F1B"])), verdict


def test_when_a_rank_hangs(tutorial_runs):
    """Issue 27's tutorial: the wrong collective, a stuck loader, a NaN, each found from the
    notebook; the sentences of its text rest on these outputs."""
    nb, out = run_notebook("11_when_a_rank_hangs.ipynb", tutorial_runs)
    text = "\n".join(out)
    assert "mismatched collectives: rank 0 is in all_reduce #4 (1 float32); rank 1 is in " \
           "broadcast #4 (1 float32)." in text
    assert "log_metrics -> c10d_logger.py:83 wrapper -> distributed_c10d.py:" in text
    # each rank's place: the cell that defined the function, the line counted in that cell
    assert "rank 1: <string in Cell In[3]>:3 <module> -> Cell In[2]:18 log_metrics -> " in text
    assert "rank 0: <string in Cell In[3]>:3 <module> -> Cell In[2]:16 log_metrics -> " in text
    # the text names the line the output gives, and that line is rank 0's all_reduce
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert "`Cell In[2]:16 log_metrics` is line 16" in "".join(
        c.source for c in nb.cells if c.cell_type == "markdown")
    assert "dist.all_reduce(w.sum()" in code[1].splitlines()[15]
    assert "dist.broadcast(" in code[1].splitlines()[17]
    for name in ("SLOW_STEP", "NAN_STEP"):  # issue 35: set and never used
        assert name not in "".join(code)
    assert "rank 1 never reached collective #3 (its last was #2); it is at Cell In[5]:5 " \
           "load_batch." in text
    assert "    Cell In[5], line 5, in load_batch\n      time.sleep(6)" in text  # its source line
    assert "> Cell In[7](13)train_step()\n-> raise FloatingPointError(" in text  # pdb, in the cell
    assert "\nstalled\njob 'train': stalled," in text and "result: [3, 3] state: done" in text
    assert "FloatingPointError on ranks [0, 1]: the gradient is not finite at step 1" in text
    assert "[None, None]" not in text  # the definitions cell shows nothing
    stacks = out[4].split("--- rank 1 ---")  # rank 0 waits in train_step's all_reduce
    assert "in train_step\n      dist.all_reduce(grad)" in stacks[0] and "load_batch" in stacks[1]
    assert not _stderr(nb)
    assert "rank 0: False\nrank 1: True" in text
