"""Bad input to the magics, as a new user types it, through a real (in-process) IPython shell:
each gets a clear error that names the value and what is expected, and the group stays usable."""
from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist.ui import magics

from cells import autodist, run  # tests/notebooks, on sys.path

pytestmark = pytest.mark.timeout(120)


def shown(captured) -> str:
    """Everything the cell showed (traceback included), without colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", captured.stdout + captured.stderr)


def usable(group) -> None:
    assert group.state == "ready"
    assert group.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]


# ---- code that does not compile -------------------------------------------------------------
@pytest.mark.parametrize("options", ["", "--trace", "--bg", "--bg later", "-q --ranks 1"])
def test_a_cell_that_does_not_compile_shows_the_syntax_error_alone(shell, dist_group, options):
    result, captured = run(shell, f"%%dist {options}\nnever_ran = 1\ny = (\n")
    text = shown(captured)
    assert result.error_in_exec is not None
    assert isinstance(result.error_in_exec.__cause__, SyntaxError)
    assert "SyntaxError: '(' was never closed" in text
    assert re.search(r"Cell In\[\d+\], line 3\n\s+y = \(\n\s+\^", text), text  # the cell's line 3
    assert "Traceback" not in text and "nbdist" not in text and "site-packages" not in text, text
    assert "later" not in shell.user_ns  # no job was started
    assert dist_group.exec("'never_ran' in globals() or '_nbdist_trace' in globals()") == \
        [False, False]
    usable(dist_group)


def test_a_statement_that_does_not_compile_points_into_its_line(shell, dist_group):
    result, captured = run(shell, "a = 1\n%dist y = (\n")
    text = shown(captured)
    assert isinstance(result.error_in_exec.__cause__, SyntaxError)
    assert re.search(r"Cell In\[\d+\], line 2\n\s+y = \(\n", text), text
    assert "Traceback" not in text and "nbdist" not in text, text
    usable(dist_group)


def test_under_autodist_the_line_numbers_are_the_cells_own(shell, dist_group):
    with autodist(shell):
        result, captured = run(shell, "first = 1\nsecond = (\n")
    assert isinstance(result.error_in_exec.__cause__, SyntaxError)
    assert re.search(r"Cell In\[\d+\], line 2\n\s+second = \(\n", shown(captured))
    _, captured = run(shell, "%%dist\nfirst = 1\nsecond = (\n")  # typed: the code from line 2
    assert re.search(r"Cell In\[\d+\], line 3\n\s+second = \(\n", shown(captured))
    usable(dist_group)


@pytest.mark.parametrize("line,fixed", [
    ("print(rank) --ranks 1", "%dist --ranks 1 print(rank)"),
    ("print(rank) --timeout 5 --quiet", "%dist --timeout 5 --quiet print(rank)"),
    ("x = (rank -q", None),  # a real syntax error before the "option": shown as one
])
def test_options_after_the_statement_are_refused_with_the_line_rewritten(shell, dist_group,
                                                                        line, fixed):
    if fixed is None:
        result, captured = run(shell, f"%dist {line}")
        assert isinstance(result.error_in_exec.__cause__, SyntaxError)
        assert "options go before" not in shown(captured)
        return
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("dist", line)
    message = str(info.value)
    assert "options go before the statement" in message, message
    assert fixed in message, message
    assert message.splitlines()[-1].startswith("usage: %dist")
    usable(dist_group)


def test_valid_code_that_ends_like_an_option_runs_as_code(shell, dist_group):
    shell.run_line_magic("dist", "value = world_size --rank")  # world_size - (-rank)
    assert dist_group.pull("value") == [2, 3]


# ---- restart: checked before the running group is stopped -----------------------------------
@pytest.mark.parametrize("line,message", [
    ("--timeout 0.0001", "argument --timeout: expected at least 1 s"),
    ("--init-timeout 0.5", "argument --init-timeout: expected at least 1 s"),
    ("-n 10000", "or pass --max-world-size N to raise the limit"),
    ("--debug nope", "--debug LEVEL got 'nope'; accepted: 'detail' (torch's "
                     "TORCH_DISTRIBUTED_DEBUG=DETAIL: collectives checked across ranks, a mismatch "
                     "named) or 'off' (the default)"),
])
def test_restart_refuses_before_it_stops_anything_and_names_its_own_options(
        shell, dist_group, line, message):
    pids = [r.pid for r in dist_group.status().ranks]
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("dist_restart", line)
    assert message in str(info.value)
    assert "max_world_size=" not in str(info.value) and "init_timeout=" not in str(info.value)
    assert [r.pid for r in dist_group.status().ranks] == pids  # the same ranks, still running
    usable(dist_group)


def test_a_slow_start_advises_the_magics_init_timeout(shell, no_group):
    ns = {"__name__": "__main__"}
    exec("import time, torch.distributed as dist\n"
         "def create(store, rank, size, timeout):\n"
         "    time.sleep(30)\n"
         "    return dist.ProcessGroupGloo(store, rank, size, timeout)\n", ns)
    nbdist.register_backend("sleepy", ns["create"], devices=["cpu"], replace=True)
    try:
        with pytest.raises(nbdist.DistTimeoutError) as info:
            shell.run_line_magic("dist_start", "--backend sleepy --init-timeout 1 --timeout 60")
        assert "did not finish starting within 1 s" in str(info.value)
        assert "Raise --init-timeout S" in str(info.value), str(info.value)
        with pytest.raises(nbdist.DistTimeoutError, match="Raise init_timeout="):
            nbdist.start(2, backend="sleepy", init_timeout=1, timeout=60)  # the API's keyword
    finally:
        nbdist.backends.unregister_backend("sleepy")
    assert magics.current_group() is None


def test_start_with_a_bad_debug_level_is_refused_naming_the_magics_option(shell, no_group):
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("dist_start", "--debug verbose")
    assert str(info.value).startswith("--debug LEVEL got 'verbose'; accepted: 'detail' ")
    assert "usage: %dist_start" in str(info.value)
    assert magics.current_group() is None
