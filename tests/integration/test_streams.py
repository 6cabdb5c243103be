"""A rank's output through pipes (issue 26): Windows' only way, run on Linux with
``NBDIST_STREAMS=pipe``, and a protected group's way. A Windows socket is not a C-runtime file
descriptor (``dup2`` refuses it), and Windows' ``select`` takes sockets only: here the ranks'
``select`` is made to refuse pipes as Windows' does, and output must still flow while a call runs;
the lifeline beside the piped stderr must still carry interrupts. The output tests of
test_group, test_lifecycle and test_quiet_ranks run under every path too (stream_paths.py).
"""
import threading
import time

import psutil
import pytest

import nbdist
from stream_paths import STREAM_PATHS, each_stream_path

pytestmark = pytest.mark.timeout(120)

PIPED = pytest.mark.parametrize("streams", [STREAM_PATHS["pipe"], STREAM_PATHS["protect"]],
                                ids=["pipe", "protect"])

#: On the ranks: select() refuses what is not a socket, as Windows' does ([WinError 10038]).
SOCKETS_ONLY_SELECT = """
import os, select, stat
_select = select.select
def _sockets_only(rlist, wlist, xlist, *timeout):
    for f in (*rlist, *wlist, *xlist):
        if not stat.S_ISSOCK(os.fstat(f if isinstance(f, int) else f.fileno()).st_mode):
            raise OSError(10038, "An operation was attempted on something that is not a socket")
    return _select(rlist, wlist, xlist, *timeout)
select.select = _sockets_only
del select.poll, select.epoll
"""


@PIPED
def test_output_flows_while_a_call_runs_without_select_on_pipes(streams):
    seen = threading.Event()
    lines = []

    def sink(rank, stream, text):
        lines.extend(text.splitlines())
        if "second" in text:
            seen.set()

    with nbdist.start(2, output=sink, **streams) as g:
        g.exec(SOCKETS_ONLY_SELECT)
        job = g.submit_exec("import time\nprint('first', flush=True)\ntime.sleep(0.3)\n"
                            "print('second', flush=True)\ntime.sleep(60)", ranks=[0])
        try:
            assert seen.wait(15), f"the second line never came while the call ran: {lines}"
            assert job.running()
        finally:
            job.interrupt()  # through the lifeline, beside the piped stderr
        assert job.wait(15) and job.state == "interrupted"
        assert g.run(lambda: 1) == [1, 1]
    assert lines[:2] == ["first", "second"]


@PIPED
def test_interrupts_and_kills_travel_beside_a_piped_stderr(streams):
    """The watchdog reads the stderr socket while the pump writes to it: Ctrl-C interrupts the
    ranks, and a rank stuck in a collective is killed after the grace period."""
    with nbdist.start(2, grace=2.0, **streams) as g:
        pids = [r.pid for r in g.status().ranks]
        job = g.submit_exec("import time; time.sleep(60)")
        time.sleep(0.5)
        job.interrupt()
        assert job.wait(15) and job.state == "interrupted"
        assert [r.pid for r in g.status().ranks] == pids  # interrupted, not killed
        job = g.submit_exec("import time\nif rank == 1: time.sleep(60)\n"
                            "t = torch.ones(1); dist.all_reduce(t)")
        time.sleep(0.5)
        job.interrupt()
        assert job.wait(30)
        with pytest.raises(nbdist.GroupInterrupted, match="rank 0 did not react"):
            job.result()
        g.restart()
        assert g.exec("t = torch.ones(1); dist.all_reduce(t); t.item()") == [2.0, 2.0]


@each_stream_path
def test_a_rank_that_ends_itself_is_heard_to_its_last_line(streams):
    """os._exit right after a C-level write and an unflushed print: on every path the words reach
    RankDiedError (on the pipe paths the pump used to die with the process before it read them)."""
    with nbdist.start(2, **streams) as g:
        with pytest.raises(nbdist.RankDiedError) as info:
            g.exec("import os, sys, time\nif rank == 1:\n"
                   "    os.write(2, b'C-level last words\\n')\n"
                   "    sys.stderr.write('unflushed python words\\n')\n"
                   "    sys.stderr.write('no newline at the end')\n"
                   "    os._exit(5)\ntime.sleep(30)")
        text = str(info.value)
        assert "rank 1 exited with code 5" in text
        for words in ("C-level last words", "unflushed python words", "no newline at the end"):
            assert words in text, text


@pytest.mark.timeout(30)
def test_an_unknown_stream_mode_is_refused_before_any_rank_starts(monkeypatch):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"NBDIST_STREAMS must be one of 'socket', 'pipe' on "
                                         r"this platform, got 'pipes'; unset it for the default "
                                         r"\('socket'\)"):
        nbdist.start(2, env={"NBDIST_STREAMS": "pipes"})
    monkeypatch.setenv("NBDIST_STREAMS", "fifo")
    with pytest.raises(ValueError, match="got 'fifo'"):
        nbdist.start(2)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


WITHOUT_STD_FDS = """
import os, sys
result = sys.argv[1]
os.close(1), os.close(2)  # as a Windows parent without a console (or pytest's capture under Wine)
sys.stdout = sys.stderr = None  # what Python makes of them when it starts without them
import nbdist
lines = []
with nbdist.start(2, start_method=sys.argv[2], output=lambda r, s, t: lines.append((r, s, t)),
                  **eval(sys.argv[3])) as g:
    values = g.exec("print('hello from', rank); rank * 10")
with open(result, "w") as f:
    f.write(repr((values, sorted(lines))))
"""


@each_stream_path
def test_ranks_started_without_stdout_and_stderr_connect_their_streams(streams, tmp_path):
    """A process started with no stdout and stderr gives its workers none: Python makes
    ``sys.stdout`` None there. Such ranks still connect their streams, and print (a spare
    spawned while pytest captured the kernel's output under Wine exited with code 1 when it
    became a rank, saying nothing: ``sys.stderr.flush()`` on None)."""
    import subprocess
    import sys

    result = tmp_path / "result.txt"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_STD_FDS, str(result), "spawn",
                           repr(streams)], timeout=90, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0 and result.exists()
    values, lines = eval(result.read_text())
    assert values == [0, 10]
    assert [(r, s, t.strip()) for r, s, t in lines] == [
        (0, "stdout", "hello from 0"), (1, "stdout", "hello from 1")]
