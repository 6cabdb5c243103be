"""nbdist's magics, through a real (in-process) IPython shell: every magic's help, and wrong
arguments refused with a UsageError that gives the usage line, before anything runs."""
from __future__ import annotations

import threading

import pytest
from IPython.core.error import UsageError

from nbdist.ui import magics

from cells import run  # tests/notebooks, on sys.path

HELP = {
    "dist_start": "Start a group of worker processes and make it the current one.",
    "dist_restart": "Restart the current group with fresh workers",
    "dist_stop": "Stop the current group's workers",
    "dist_status": "Show each rank's state, pid, device, backend and memory",
    "dist": "Run Python code on the ranks",
    "autodist": "Toggle running every cell on the ranks",
    "dist_push": "Copy kernel variables, by name, to the ranks",
    "dist_pull": "Copy variables from the ranks into the kernel",
}



# ---- help and usage ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HELP))
def test_every_magic_has_help(shell, name):
    _, captured = run(shell, f"%{name}?")
    assert f"  %{name}" in captured.stdout  # the usage line
    assert HELP[name] in captured.stdout


@pytest.mark.timeout(60)
def test_cell_magic_has_help(shell):
    _, captured = run(shell, "%%dist?")
    assert "Run Python code on the ranks" in captured.stdout
    assert "--ranks" in captured.stdout
    assert "--all-output" in captured.stdout and "Quiet ranks" in captured.stdout


USAGE_ERRORS = [
    ("dist_start", "-n 0", "argument -n/--world-size: expected a positive int, got '0'"),
    ("dist_start", "-n two", "expected a positive int, got 'two'"),
    ("dist_start", "--timeout 0",
     "argument --timeout: expected a positive number of seconds, e.g. 30; got '0'"),
    ("dist_start", "--bogus", "unrecognized arguments: --bogus"),
    ("dist_restart", "-n -1", "expected a positive int, got '-1'"),
    ("dist_restart", "--backend bogus", "unknown backend 'bogus'"),
    ("dist_stop", "now", "unrecognized arguments: now"),
    ("dist_status", "-v", "unrecognized arguments: -v"),
    ("dist", "", "%dist needs a statement to run on the ranks"),
    ("dist", "--ranks", "argument --ranks: expected one argument"),
    ("dist", "--ranks a,b rank", "expected rank numbers separated by commas, e.g. 0,2; got 'a,b'"),
    ("dist", "--ranks -1 rank", "expected rank numbers separated by commas"),
    ("dist", "--ranks 0,5 rank", "--ranks 5: the group has ranks 0..1"),
    ("dist", "--timeout -1 rank", "expected a positive number of seconds, e.g. 30; got '-1'"),
    ("dist", "--nope rank", "unrecognized arguments: --nope"),
    ("dist", "--t 5 rank", "ambiguous option: --t could match --timeout, --trace"),
    ("dist", "--every 5 rank", "unrecognized arguments: --every\nusage"),
    ("autodist", "--ranks x", "expected rank numbers separated by commas"),
    ("dist_push", "", "the following arguments are required: names"),
    ("dist_push", "not_defined_anywhere", "not defined in the kernel: not_defined_anywhere"),
    ("dist_push", "--ranks 7 some_value", "--ranks 7: the group has ranks 0..1"),
    ("dist_push", "a_lock", "cannot send the pushed value to the ranks"),
    ("dist_pull", "", "the following arguments are required: names"),
    ("dist_pull", "--rank 9 rank", "--rank 9: the group has ranks 0..1"),
    ("dist_pull", "--rank x rank", "argument --rank: expected a rank number, e.g. 0; got 'x'"),
    ("dist_pull", "--rank -1 rank", "argument --rank: expected a rank number, e.g. 0; got '-1'"),
    ("dist", "--timeout nan rank", "expected a positive number of seconds, e.g. 30; got 'nan'"),
    ("dist", "--timeout inf rank", "expected a positive number of seconds, e.g. 30; got 'inf'"),
    ("dist", "--timeout -1e3 rank", "argument --timeout: expected a positive number of seconds, "
     "e.g. 30; got '-1e3'"),  # a value that starts with a minus is still the option's value
    ("dist_start", "--timeout 1e999", "expected a positive number of seconds, e.g. 30; got '1e9"),
    ("dist_restart", "--timeout nan", "expected a positive number of seconds, e.g. 30; got 'nan'"),
    ("dist_restart", "--device tpu", "device must be 'auto' or one of"),
    ("autodist", "--ranks 5", "--ranks 5: the group has ranks 0..1"),
    ("autodist", "--timeout inf", "expected a positive number of seconds, e.g. 30; got 'inf'"),
    ("dist_pull", "1x", "pull() takes variable names, got '1x'"),
    ("dist", "--bg for rank", "argument --bg: expected a variable name for the job, e.g. train; "
     "got 'for' (a Python keyword: no code could use a variable of that name)"),
    ("dist", "--bg 2x rank", "argument --bg: expected a variable name for the job, e.g. train; "
     "got '2x'"),
    ("dist_pull", "None", "pull() takes variable names, got 'None' (a Python keyword)"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,line,message", USAGE_ERRORS)
def test_wrong_arguments_raise_usage_error_with_usage_line(shell, dist_group, name, line,
                                                           message):
    shell.user_ns.update(some_value=1, a_lock=threading.Lock())
    with pytest.raises(UsageError) as info:
        shell.run_line_magic(name, line)
    assert message in str(info.value)
    assert str(info.value).splitlines()[-1].startswith(f"usage: %{name}")
    assert dist_group.state == "ready"  # a bad --backend is refused before anything is stopped


@pytest.mark.timeout(60)
def test_cell_form_usage_error(shell, dist_group):
    with pytest.raises(UsageError, match="unrecognized arguments: --rank-list 0\nusage: %dist "):
        shell.run_cell_magic("dist", "--rank-list 0", "rank")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line", ["--ranks 5", "--trace --ranks 5", "--trace --ranks 0,5 -q"])
def test_cell_form_checks_ranks_before_anything_runs(shell, dist_group, line):
    with pytest.raises(UsageError, match="--ranks 5: the group has ranks 0..1\nusage: %dist "):
        shell.run_cell_magic("dist", line, "traced_or_not = rank")
    assert dist_group.exec("'traced_or_not' in globals() or '_nbdist_trace' in globals()") == \
        [False, False]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line", ["%dist rank", "%dist_restart", "%autodist", "%dist_push x",
                                  "%dist_pull x"])
def test_without_a_group_magics_say_how_to_start_one(shell, no_group, line):
    shell.user_ns["x"] = 1
    result, captured = run(shell, line)
    assert isinstance(result.error_in_exec, UsageError)
    assert "no nbdist group is running: start one with %dist_start -n 2" in captured.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("line,message", [
    ("--backend bogus", "unknown backend 'bogus'"),
    ("-n 100000", "world_size=100000 is more than this machine runs well on device 'cpu'"),
    ("-n 100000", "Use a smaller world size, or pass --max-world-size N to raise the limit."),
    ("--timeout 0.5", "argument --timeout: expected at least 1 s"),
    ("--threads 0", "argument --threads: expected a positive int, got '0'"),
    ("--device tpu", "device must be 'auto' or one of ['cpu', 'cuda', 'xpu'], got 'tpu'"),
])
def test_start_refuses_what_the_group_refuses(shell, no_group, line, message):
    with pytest.raises(UsageError) as info:
        shell.run_line_magic("dist_start", line)
    assert message in str(info.value)
    assert str(info.value).splitlines()[-1].startswith("usage: %dist_start [-n N]")
    assert magics.current_group() is None


@pytest.mark.timeout(60)
def test_status_and_stop_without_a_group(shell, no_group):
    assert "nbdist: no group is running; start one with %dist_start." in \
        run(shell, "%dist_status")[1].stdout
    assert "nbdist: no group is running." in run(shell, "%dist_stop")[1].stdout
