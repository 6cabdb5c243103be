"""Code from a notebook cell, named by its cell (issue 35; nbdist.runtime.cells), without ranks:
the pickler keeps a code object's file name (cloudpickle writes ``<dynamic-code>``), the name and
text a cell travels with, where exec'd source sits in its cell, how a rank moves the parsed source
there, and how a remote traceback reads (``Cell In[5], line 4``, no nbdist frames)."""
from __future__ import annotations

import ast
import linecache
import os

import pytest

from nbdist.runtime import cells, recorder, requests
from nbdist.wire import serialize

CELL = "/tmp/ipykernel_1/123.py"  # a file name as ipykernel gives a cell's code (no such file)
SOURCE = "def scale(x):\n    y = x * 2\n    if y > 10:\n        raise ValueError(f'too big {y}')\n" \
         "    return y\n"


@pytest.fixture
def kernel_cell(monkeypatch):
    """A cell the kernel knows as ``Cell In[7]`` (the hook the notebook layer sets), its code
    compiled under ipykernel's kind of file name and held in linecache, as IPython does."""
    monkeypatch.setitem(linecache.cache, CELL, (len(SOURCE), None, SOURCE.splitlines(True), CELL))
    monkeypatch.setattr(cells, "CELLS", lambda f: ("Cell In[7]", SOURCE) if f == CELL else None)
    ns = {"__name__": "__main__"}
    exec(compile(SOURCE, CELL, "exec"), ns)
    return ns["scale"]


def test_code_from_a_cell_travels_under_its_cells_name(kernel_cell):
    naming = cells.Naming()
    data, _ = serialize.dumps(kernel_cell, code_names=naming)
    assert serialize.loads(data).__code__.co_filename == "Cell In[7]"
    assert naming.texts == {"Cell In[7]": SOURCE}  # what the ranks get once


def test_a_request_carries_the_cells_text_beside_its_payload_not_in_it(kernel_cell):
    req = requests.run_request(kernel_cell, (21,), {}, "/nonexistent/nbdist-test-")
    assert req.cells == {"Cell In[7]": SOURCE}  # sent to a rank once (send_missing), not per call
    assert b"if y > 10" not in req.payload  # the source itself
    pushed = requests.push_request({"fn": kernel_cell}, "/nonexistent/nbdist-test-")
    assert pushed.cells == {"Cell In[7]": SOURCE}


def test_without_names_cloudpickle_writes_dynamic_code(kernel_cell):
    data, _ = serialize.dumps(kernel_cell)
    assert serialize.loads(data).__code__.co_filename == "<dynamic-code>"


def test_nested_code_and_real_files_keep_their_names(kernel_cell):
    def outer():  # this file: a real one, which keeps its path
        return lambda: 1

    naming = cells.Naming()
    got = serialize.loads(serialize.dumps(outer, code_names=naming)[0])
    assert got.__code__.co_filename == __file__ and got().__code__.co_filename == __file__
    assert naming.texts == {}  # the ranks read a real file themselves


def test_without_the_hook_a_file_held_only_in_linecache_keeps_its_name(kernel_cell, monkeypatch):
    monkeypatch.setattr(cells, "CELLS", None)  # no notebook layer: e.g. IPython not imported
    assert cells.cell_of(CELL) == (CELL, SOURCE)
    assert cells.cell_of(__file__) is None
    assert cells.cell_of("/no/such/file.py") is None


@pytest.mark.parametrize("text, source, line, where", [
    ("%%dist\nx = 1\nraise KeyError(x)\n", "x = 1\nraise KeyError(x)", 1, (1, 0)),
    ("a = 1\n%dist --ranks 0 y = 1 / 0\n", "y = 1 / 0", 2, (1, 16)),
    ("g.exec('''\nimport time\n''')\njob = g.submit_exec('slow()')\n", "slow()", 4, (3, 21)),
])
def test_exec_source_is_found_where_the_cell_has_it(monkeypatch, text, source, line, where):
    monkeypatch.setattr(cells, "CELLS", lambda f: ("Cell In[3]", text) if f == "cell3" else None)
    ns = {"locate": cells.locate, "SRC": source}
    exec(compile("\n" * (line - 1) + "found = locate(SRC)\n", "cell3", "exec"), ns)
    assert ns["found"] == ("Cell In[3]", text) + where


def test_exec_source_built_in_code_runs_as_a_string_of_its_cell(monkeypatch):
    monkeypatch.setattr(cells, "CELLS", lambda f: ("Cell In[3]", "g.exec('a\\nb')\n")
                        if f == "cell3" else None)
    ns = {"locate": cells.locate, "SRC": "a\nb"}
    exec(compile("found = locate(SRC)\n", "cell3", "exec"), ns)
    assert ns["found"] == ("<string in Cell In[3]>", "", 0, 0)


def test_exec_source_not_sent_from_a_cell_is_not_placed(monkeypatch):
    monkeypatch.setattr(cells, "CELLS", lambda f: None)
    assert cells.locate("x = 1") is None
    monkeypatch.setattr(cells, "CELLS", None)
    assert cells.locate("x = 1") is None


def test_shift_moves_parsed_source_to_its_place_in_the_cell():
    tree = cells.shift(ast.parse("y = 1 / 0\nz = 2"), 4, 16)
    first, second = tree.body
    assert (first.lineno, first.col_offset, first.end_col_offset) == (5, 16, 25)
    assert (first.value.lineno, first.value.col_offset) == (5, 20)
    assert (second.lineno, second.col_offset) == (6, 0)  # later lines keep their columns


def test_a_remote_traceback_shows_the_cell_and_leaves_out_nbdists_frames(monkeypatch):
    monkeypatch.setattr(linecache, "cache", dict(linecache.cache))  # what a rank registers
    cells.register({"Cell In[7]": SOURCE})
    ns = {"__name__": "__main__"}
    exec(compile(SOURCE, "Cell In[7]", "exec"), ns)
    wrapped = recorder._wrap("all_reduce", ns["scale"], bytes, bytearray)  # nbdist's own frame
    try:
        wrapped(21)
    except ValueError as err:
        text = cells.format_failure(err)
    assert "  Cell In[7], line 4, in scale\n    raise ValueError(f'too big {y}')\n" in text
    assert "recorder.py" not in text and 'File "Cell' not in text
    assert text.endswith("ValueError: too big 42\n")


def test_chained_exceptions_are_cleaned_too():
    def inner():
        raise KeyError("k")

    try:
        try:
            recorder._wrap("barrier", inner, bytes, bytearray)()
        except KeyError as err:
            raise RuntimeError("outer") from err
    except RuntimeError as err:
        text = cells.format_failure(err)
    assert "recorder.py" not in text and "KeyError: 'k'" in text and "in inner" in text


def test_places_read_as_ipython_writes_them():
    assert cells.place("Cell In[5]", 4) == "Cell In[5], line 4"
    assert cells.place("<string in Cell In[5]>", 2) == "<string in Cell In[5]>:2"
    assert cells.short("Cell In[5]", 4, "scale") == "Cell In[5]:4 scale"
    path = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")
    assert cells.short(path, 2950, "all_reduce") == "distributed_c10d.py:2950 all_reduce"


class _Rank:
    def __init__(self):
        self.cells, self.sent = {}, []
        self.channel = self

    def send_bytes(self, data):
        self.sent.append(data)


def test_a_cells_text_reaches_a_rank_once_and_again_when_it_changed():
    rank = _Rank()
    cells.send_missing(rank, {"Cell In[7]": SOURCE})
    cells.send_missing(rank, {"Cell In[7]": SOURCE})
    assert len(rank.sent) == 1
    cells.send_missing(rank, {"Cell In[7]": SOURCE + "x = 1\n"})  # same number, new text
    cells.send_missing(rank, {})
    assert len(rank.sent) == 2
