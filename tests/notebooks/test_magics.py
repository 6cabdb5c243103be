"""nbdist's magics driven through a real (in-process) IPython shell, on real worker processes."""
from __future__ import annotations

import copy
import os
import signal
import sys
import threading
import time

import psutil
import pytest
from IPython.core.magic import line_magic, magics_class
from IPython.utils.capture import capture_output

import nbdist
from nbdist.errors import GroupInterrupted, RemoteError
from nbdist.ui import magics

from cells import autodist, run, texts  # tests/notebooks, on sys.path


@pytest.fixture(scope="module", params=["forkserver", "spawn"])
def shared_group(request):
    """The group behind ``dist_group``, once per start method (spawn: the Windows path, issue 20)."""
    with nbdist.start(2, backend="gloo", device="cpu", timeout=30,
                      start_method=request.param) as g:
        yield g


# ---- running cells ----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_cell_output_is_labelled_by_rank_and_values_shown_per_rank(shell, dist_group):
    result, captured = run(shell, "%%dist\n"
                                  "t = torch.tensor([rank + 1.0])\n"
                                  "dist.all_reduce(t)\n"
                                  "print('sum', t.item())\n"
                                  "t")
    assert result.success
    assert "[ranks 0, 1] sum 3.0" in captured.stdout  # the same line from both ranks: once
    assert texts(captured) == ["Out[rank 0]: tensor([3.])", "Out[rank 1]: tensor([3.])"]


@pytest.mark.timeout(120)
def test_repeated_lines_show_once_and_all_output_shows_every_line(shell, dist_group):
    cell = ("import warnings\nwarnings.simplefilter('always')\n"
            "for step in range(4):\n"
            "    warnings.warn('old_api is deprecated', FutureWarning)\n"
            "    print(f'loss {rank * 10 + step}')\n")
    _, captured = run(shell, "%%dist\n" + cell)
    assert captured.stderr.count("FutureWarning: old_api is deprecated") == 2  # once, summary
    # a cell run without history (store_history=False) is not in IPython's raw history: the
    # %%dist body then runs as a string of its cell
    assert "[ranks 0, 1] <string in Cell In[" in captured.stderr
    assert "[ranks 0, 1: 4 times each] <string in Cell In[" in captured.stderr
    assert "nbdist: repeated lines were shown once" in captured.stderr
    for rank in (0, 1):
        assert [line for line in captured.stdout.splitlines()
                if line.startswith(f"[rank {rank}]")] == \
            [f"[rank {rank}] loss {rank * 10 + step}" for step in range(4)]
    _, captured = run(shell, "%%dist --all-output\n" + cell)
    assert captured.stderr.count("FutureWarning: old_api is deprecated") == 8
    assert "repeated lines" not in captured.stderr
    assert dist_group.dedupe_output is True  # --all-output was for that cell only
    assert all(len(lines) == 12 for lines in dist_group.last_output.values())


@pytest.mark.timeout(120)
def test_output_arrives_while_the_cell_runs(shell, dist_group, tmp_path):
    go = tmp_path / "go"

    def release_when_both_ranks_wait(stream):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(f"[rank {r}] waiting on {r}" in stream.getvalue() for r in (0, 1)):
                go.touch()
                return
            time.sleep(0.05)

    with capture_output() as captured:
        thread = threading.Thread(target=release_when_both_ranks_wait, args=(sys.stdout,))
        thread.start()
        shell.run_cell("%%dist\n"
                       "import pathlib, time\n"
                       "print('waiting on', rank)\n"
                       f"go, deadline = pathlib.Path({str(go)!r}), time.monotonic() + 60\n"
                       "while not go.exists() and time.monotonic() < deadline:\n"
                       "    time.sleep(0.05)\n"
                       "print('released' if go.exists() else 'never released', rank)")
        thread.join()
    assert "[rank 0] released 0" in captured.stdout and "[rank 1] released 1" in captured.stdout


@pytest.mark.timeout(120)
def test_line_form_ranks_and_quiet(shell, dist_group):
    assert texts(run(shell, "%dist --ranks 1 rank * 10")[1]) == ["Out[rank 1]: 10"]
    assert texts(run(shell, "%dist --rank 0 rank")[1]) == ["Out[rank 0]: 0"]  # abbreviation
    assert texts(run(shell, "%dist -- --rank")[1]) == ["Out[rank 0]: 0", "Out[rank 1]: 1"]
    assert texts(run(shell, "%dist --ranks=1 --timeout 30 -q rank")[1]) == []
    assert texts(run(shell, "%%dist --quiet\nrank")[1]) == []
    assert texts(run(shell, "%dist x = rank")[1]) == []  # a statement has no value
    assert texts(run(shell, "%dist -rank")[1]) == ["Out[rank 0]: 0", "Out[rank 1]: -1"]
    assert texts(run(shell, "%dist -q -rank")[1]) == []
    assert texts(run(shell, "%dist --ranks 1 -1 * rank")[1]) == ["Out[rank 1]: -1"]
    assert texts(run(shell, "%dist --ranks 0 -- --rank")[1]) == ["Out[rank 0]: 0"]


@pytest.mark.timeout(60)
def test_line_form_splits_off_any_option_the_parser_has(shell, dist_group, monkeypatch):
    """The options of %dist statement end where argparse says: an option added to the parser
    (here --every N) is split off with its value, abbreviated or not, with no list to update."""
    parser = copy.deepcopy(magics.DistMagics.dist.parser)
    parser.add_argument("--every", type=int, metavar="N")
    monkeypatch.setattr(magics.DistMagics.dist, "parser", parser)
    assert texts(run(shell, "%dist --every 3 rank")[1]) == ["Out[rank 0]: 0", "Out[rank 1]: 1"]
    assert texts(run(shell, "%dist --ev 3 --ranks 1 rank")[1]) == ["Out[rank 1]: 1"]
    assert texts(run(shell, "%dist --ranks=1 --every=3 rank")[1]) == ["Out[rank 1]: 1"]


@pytest.mark.timeout(120)
def test_rich_and_multiline_values(shell, dist_group):
    _, captured = run(shell, "%%dist\n"
                             "class Rich:\n"
                             "    def __init__(self, r): self.r = r\n"
                             "    def __repr__(self): return f'Rich({self.r})'\n"
                             "    def _repr_html_(self): return f'<i>rank {self.r}</i>'\n"
                             "Rich(rank)")
    first = captured.outputs[0].data
    assert first["text/plain"] == "Out[rank 0]: Rich(0)"
    assert first["text/html"] == "<div><b>Out[rank 0]:</b></div><i>rank 0</i>"

    _, captured = run(shell, "%%dist\n"
                             "class Picture:\n"
                             "    def _repr_png_(self): return b'\\x89PNG-rank%d' % rank\n"
                             "Picture()")
    assert len(captured.outputs) == 4  # a header, then the object as it is, per rank
    assert captured.outputs[0].data["text/plain"] == "Out[rank 0]:"
    assert captured.outputs[1].data["image/png"] == b"\x89PNG-rank0"
    assert captured.outputs[3].data["image/png"] == b"\x89PNG-rank1"

    _, captured = run(shell, "%dist torch.ones(2, 2) * rank")
    assert texts(captured)[1] == "Out[rank 1]:\ntensor([[1., 1.],\n        [1., 1.]])"

    _, captured = run(shell, "%%dist\n"
                             "class Shows:\n"
                             "    def __init__(self, r): self.r = r\n"
                             "    def _ipython_display_(self): print('shown by itself', self.r)\n"
                             "Shows(rank)")
    assert captured.outputs == [] and "shown by itself 1" in captured.stdout


@pytest.mark.timeout(120)
def test_remote_error_shows_the_remote_traceback_then_the_group_works(shell, dist_group):
    result, captured = run(shell, "%%dist\n"
                                  "def divide(x):\n"
                                  "    return 1 / x\n"
                                  "divide(rank)")
    assert isinstance(result.error_in_exec, RemoteError)
    assert result.error_in_exec.ranks == [0]
    out = captured.stdout
    assert "--- rank 0 ---" in out and "--- rank 1 ---" not in out
    assert "in divide" in out and "ZeroDivisionError: division by zero" in out
    assert "group.py" not in out and "magics.py" not in out
    assert texts(run(shell, "%dist rank")[1]) == ["Out[rank 0]: 0", "Out[rank 1]: 1"]


@pytest.mark.timeout(60)
def test_syntax_error_is_reported_without_a_round_trip(shell, dist_group):
    result, captured = run(shell, "%%dist\nx = (")
    assert isinstance(result.error_in_exec.__cause__, SyntaxError)  # shown as in a local cell
    assert "'(' was never closed" in captured.stdout


@pytest.mark.timeout(120)
def test_timeout_says_what_happened(shell, magic_group):
    result, captured = run(shell, "%dist --timeout 1 __import__('time').sleep(60)")
    assert type(result.error_in_exec).__name__ == "DistTimeoutError"
    assert "DistTimeoutError" in captured.stdout and "still running after 1 s" in captured.stdout
    assert "group.py" not in captured.stdout


@pytest.mark.timeout(120)
def test_interrupt_says_what_happened(shell, magic_group, tmp_path):
    def interrupt_when_both_ranks_sleep():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all((tmp_path / f"sleeping-{r}").exists() for r in (0, 1)):
                os.kill(os.getpid(), signal.SIGINT)  # what "interrupt kernel" does to the kernel
                return
            time.sleep(0.05)

    thread = threading.Thread(target=interrupt_when_both_ranks_sleep)
    thread.start()
    result, captured = run(shell, "%%dist\n"
                                  "import pathlib, time\n"
                                  f"pathlib.Path({str(tmp_path)!r}, f'sleeping-{{rank}}').touch()\n"
                                  "time.sleep(60)")
    thread.join()
    assert isinstance(result.error_in_exec, GroupInterrupted)
    assert "GroupInterrupted" in captured.stdout and "interrupted ranks 0, 1" in captured.stdout
    assert "group.py" not in captured.stdout


@pytest.mark.timeout(180)
def test_dead_rank_then_closed_group_then_restart(shell, magic_group):
    result, captured = run(shell, "%%dist\nimport os\nif rank == 1:\n    os._exit(3)")
    assert type(result.error_in_exec).__name__ == "RankDiedError"
    assert "rank 1 exited with code 3" in captured.stdout
    result, captured = run(shell, "%dist rank")
    assert type(result.error_in_exec).__name__ == "GroupClosedError"
    assert "this group is broken" in captured.stdout
    _, captured = run(shell, "%dist_restart -n 1")
    assert "nbdist: restarted 1 ranks (backend gloo, device cpu)" in captured.stdout
    assert texts(run(shell, "%dist world_size")[1]) == ["Out[rank 0]: 1"]
    run(shell, "%dist_restart -n 2")


@pytest.mark.timeout(180)
def test_dist_start_follows_the_start_method_environment_variable(shell, no_group, monkeypatch):
    """The magics have no start-method flag: ``NBDIST_START_METHOD=spawn`` in the kernel's
    environment makes ``%dist_start`` (and its restarts) spawn the ranks (issue 20)."""
    monkeypatch.setenv("NBDIST_START_METHOD", "spawn")
    shell.run_line_magic("dist_start", "-n 2")
    group = magics.current_group()
    try:
        assert group.run(os.getppid) == [os.getpid()] * 2  # spawned by the kernel itself
        _, captured = run(shell, "%dist_restart -n 1")
        assert "restarted 1 ranks" in captured.stdout
        assert group.run(os.getppid) == [os.getpid()]
    finally:
        group.stop()
        magics.use_group(None)


# ---- variables and status ---------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_push_and_pull_tensors(shell, dist_group):
    import torch

    shell.user_ns["x"] = torch.arange(4.0)
    shell.user_ns["scale"] = 10
    shell.run_line_magic("dist_push", "x scale")
    shell.run_cell_magic("dist", "", "y = x * (rank + 1) * scale")
    shell.run_line_magic("dist_pull", "y")
    assert [v.tolist() for v in shell.user_ns["y"]] == [[0, 10, 20, 30], [0, 20, 40, 60]]
    shell.run_line_magic("dist_pull", "y --rank 1")
    assert shell.user_ns["y"].tolist() == [0, 20, 40, 60]
    shell.run_line_magic("dist_pull", "rank world_size")
    assert shell.user_ns["rank"] == [0, 1] and shell.user_ns["world_size"] == [2, 2]

    shell.user_ns["only0"] = "zero"
    shell.run_line_magic("dist_push", "only0 --ranks 0")
    assert texts(run(shell, "%dist 'only0' in globals()")[1]) == \
        ["Out[rank 0]: True", "Out[rank 1]: False"]
    with pytest.raises(RemoteError, match="'only0' not defined on rank 1"):
        shell.run_line_magic("dist_pull", "only0")


@pytest.mark.timeout(60)
def test_status_is_a_table(shell, dist_group):
    _, captured = run(shell, "%dist_status")
    data = captured.outputs[0].data
    assert data["text/plain"].startswith("group: ready, world size 2, backend gloo")
    assert "<table>" in data["text/html"]
    for r in dist_group.status().ranks:
        assert str(r.pid) in data["text/plain"]


# ---- autodist ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_autodist_runs_every_cell_on_the_ranks_until_toggled_off(shell, dist_group):
    shell.user_ns.pop("on_ranks", None)
    _, captured = run(shell, "%autodist")
    assert "autodist on: every cell runs on the ranks; %autodist turns it off." in captured.stdout
    try:
        assert shell.input_transformer_manager.check_complete("a = 1\n")[0] == "complete"
        assert texts(run(shell, "on_ranks = rank * 100\non_ranks")[1]) == \
            ["Out[rank 0]: 0", "Out[rank 1]: 100"]
        assert "on_ranks" not in shell.user_ns
        _, captured = run(shell, "%dist_status")  # magics run in the kernel
        assert captured.outputs[0].data["text/plain"].startswith("group: ready")
    finally:
        _, captured = run(shell, "%autodist")
    assert "autodist off: cells run in the kernel again." in captured.stdout
    run(shell, "local_again = 5")
    assert shell.user_ns["local_again"] == 5


@pytest.mark.timeout(120)
def test_autodist_options_apply_to_every_cell(shell, dist_group):
    with autodist(shell, "--ranks 1 --timeout 30 -q --all-output"):
        _, captured = run(shell, "print('from', rank)\nprint('from', rank)\nrank")
    assert captured.stdout.count("[rank 1] from 1") == 2 and "[rank 0]" not in captured.stdout
    assert captured.outputs == []


# ---- lifecycle --------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_start_reports_the_running_group(shell, dist_group):
    _, captured = run(shell, "%dist_start -n 3")
    assert "nbdist: a group is already running: <nbdist.Group" in captured.stdout
    assert magics.current_group() is dist_group and dist_group.world_size == 2


@pytest.mark.timeout(120)
def test_stop_leaves_no_worker_behind(shell, magic_group):
    pids = [r.pid for r in magic_group.status().ranks]
    run(shell, "%autodist")
    _, captured = run(shell, "%dist_stop")
    assert "nbdist: group stopped." in captured.stdout
    assert magic_group.state == "stopped" and magics.current_group() is None
    assert not [p for p in pids if psutil.pid_exists(p)]
    run(shell, "cell_after_stop = 1")  # %dist_stop turned %autodist off: this runs here
    assert shell.user_ns["cell_after_stop"] == 1


@pytest.mark.timeout(180)
def test_unload_stops_the_groups_it_started_but_not_attached_ones(shell, magic_group,
                                                                 shared_group):
    shell.run_line_magic("load_ext", "nbdist")  # loaded already: harmless
    nbdist.load_ipython_extension(shell)  # called again directly: still one set of magics
    registry = shell.magics_manager.registry
    assert sum(isinstance(m, magics.DistMagics) for m in registry.values()) == 1
    run(shell, "%autodist")
    shell.run_line_magic("unload_ext", "nbdist")
    try:
        assert shell.find_line_magic("dist_start") is None
        assert shell.find_cell_magic("dist") is None
        assert not [t for t in shell.input_transformers_cleanup if "autodist" in repr(t)]
        assert magic_group.state == "stopped" and magics.current_group() is None
        shell.run_line_magic("load_ext", "nbdist")
        magics.use_group(shared_group)  # started in code, attached: its owner stops it
        assert texts(run(shell, "%dist rank")[1]) == ["Out[rank 0]: 0", "Out[rank 1]: 1"]
        shell.run_line_magic("unload_ext", "nbdist")
        assert shared_group.state == "ready" and magics.current_group() is shared_group
    finally:
        magics.use_group(None)
        shell.run_line_magic("load_ext", "nbdist")


@pytest.mark.timeout(30)
def test_use_group_takes_a_group():
    with pytest.raises(TypeError, match="use_group\\(\\) takes an nbdist.Group .or None., got str"):
        magics.use_group("g")


@pytest.mark.timeout(60)
def test_more_magics_can_be_registered(shell, monkeypatch):
    monkeypatch.setattr(magics.base, "_magic_classes", list(magics.base._magic_classes))

    @magics.register_magics
    @magics_class
    class ExtraMagics(magics.NbdistMagics):
        @line_magic
        def dist_extra(self, line=""):
            """A magic another module adds."""
            return "extra " + line

    assert shell.run_line_magic("dist_extra", "ok") == "extra ok"  # added to the loaded shell
    with pytest.raises(ValueError, match="a magics class named 'ExtraMagics' is already "
                                         "registered .registered: DistMagics, .*ExtraMagics."):
        magics.register_magics(ExtraMagics)
    shell.run_line_magic("unload_ext", "nbdist")
    assert shell.find_line_magic("dist_extra") is None
    shell.run_line_magic("load_ext", "nbdist")
    assert shell.find_line_magic("dist_extra") is not None
    shell.run_line_magic("unload_ext", "nbdist")
    monkeypatch.undo()
    shell.run_line_magic("load_ext", "nbdist")
    assert shell.find_line_magic("dist_extra") is None
