"""Post-mortem pdb on a rank from a real kernel (issue 27): %dist_debug after a RemoteError reads
pdb commands from the kernel's stdin -- answered here through jupyter_client, as a notebook's
input box would -- and runs each on the failing rank, whose frames and variables it shows."""
import pytest

from cells import real_kernel  # tests/notebooks, on sys.path

pytestmark = pytest.mark.timeout(180)

FAIL = """%%dist
def scale(batch):
    factor = batch * 2 + 1
    raise ValueError(f"bad batch {batch}")
if rank == 1:
    scale(20)
"""


@pytest.fixture
def kernel():
    manager, client = real_kernel()
    try:
        yield client
    finally:
        client.execute_interactive("%dist_stop", timeout=60)
        client.stop_channels()
        manager.shutdown_kernel(now=False)
        manager.cleanup_resources()


def run(client, code, answers=(), stdin=True):
    """Run ``code``; answer its input requests with ``answers`` in order. Returns (status,
    printed text, prompts seen, errors)."""
    out, prompts, errors, todo = [], [], [], list(answers)

    def on_output(msg):
        c, kind = msg["content"], msg["msg_type"]
        if kind == "stream":
            out.append(c["text"])
        elif kind == "error":
            errors.append(f"{c['ename']}: {c['evalue']}")

    def on_stdin(msg):
        prompts.append(msg["content"]["prompt"])
        client.input(todo.pop(0) if todo else "q")

    reply = client.execute_interactive(code, output_hook=on_output, stdin_hook=on_stdin,
                                       allow_stdin=stdin, timeout=120)
    return reply["content"]["status"], "".join(out), prompts, errors


def test_dist_debug_opens_pdb_on_the_failing_rank(kernel):
    assert run(kernel, "%load_ext nbdist\n%dist_start -n 2")[0] == "ok"
    status, _, _, errors = run(kernel, FAIL)
    assert status == "error" and "ValueError" in errors[0] and "rank 1" in errors[0], errors
    status, text, prompts, errors = run(kernel, "%dist_debug",
                                        ["p factor", "p batch", "up", "l", "where", "q"])
    assert status == "ok", errors
    assert prompts == ["(Pdb rank 1) "] * 6
    assert text.startswith("ValueError: bad batch 20\n> Cell In[2](4)scale()\n"), text  # its cell
    assert "(4)scale()\n-> raise ValueError(f\"bad batch {batch}\")\n" in text
    assert "\n41\n20\n" in text  # p factor, p batch: the rank's own variables
    assert "> Cell In[2](6)<module>()\n-> scale(20)" in text  # up: lines counted in the cell
    assert "  6  ->\t    scale(20)" in text  # l, in the frame above
    assert "  1  \t%%dist\n" in text  # the cell as typed
    # the failure stays until the rank's next call: a call ends it
    assert run(kernel, "%%dist\nrank")[0] == "ok"
    status, text, _, _ = run(kernel, "%dist_debug --rank 1")  # IPython prints a UsageError
    assert status == "error" and text.startswith(
        "UsageError: rank 1 has no failure to debug: its last call did not fail on it (a rank "
        "keeps the traceback of its last failed call until its next call)"), text


def test_dist_debug_without_an_error_says_what_it_needs(kernel):
    assert run(kernel, "%load_ext nbdist\n%dist_start -n 2")[0] == "ok"
    status, text, _, _ = run(kernel, "%dist_debug")
    assert status == "error" and text.startswith(
        "UsageError: there is no RemoteError to debug: %dist_debug opens pdb on the rank that "
        "raised the last one (run after it, as %debug), or on the rank you name with --rank R")


BREAK = """%%dist
x = 41
if rank == 1:
    breakpoint()
y = x + 1
t = torch.ones(1)
dist.all_reduce(t)
print("done", y, t.item())
"""


def test_a_breakpoint_on_a_rank_prompts_in_the_cell(kernel):
    # 15 s: rank 0 waits in its all_reduce (torch's timeout) while rank 1's pdb answers four
    # commands, and after q on rank 0 below, rank 1 waits in torch's barrier that long
    assert run(kernel, "%load_ext nbdist\n%dist_start -n 2 --timeout 15")[0] == "ok"
    status, text, prompts, errors = run(kernel, BREAK, ["p x", "n", "p y", "c"])
    assert status == "ok", (text, errors)
    assert prompts == ["(Pdb rank 1) "] * 4
    assert text.startswith("nbdist: rank 1 stopped at a breakpoint; this call's timeout is "
                           "suspended while pdb is open (c continues, q ends the call).\n")
    assert "Cell In[2](5)<module>()\n-> y = x + 1\n41\n" in text and "\n42\n" in text
    assert "done 42 2.0" in text  # rank 0 waited in the all_reduce, then both finished
    # torch's own entry point, and q
    status, text, prompts, errors = run(kernel, "%%dist\ndist.breakpoint(rank=0)\nz = 1", ["q"])
    assert prompts == ["(Pdb rank 0) "] and status == "error", (text, errors)
    assert any("pdb was quit (q) on rank 0: the call ended there" in e for e in errors), errors


BG = """%%dist --bg bp --timeout 3
x = 41 + rank
if rank == 1:
    breakpoint()
y = x + 1
t = torch.ones(1)
dist.all_reduce(t)
y * 10 + t.item()
"""


def test_a_background_job_pauses_at_a_breakpoint_and_dist_debug_attaches(kernel):
    start = "%load_ext nbdist\nimport nbdist\ng = nbdist.start(2, stall=1)"
    assert run(kernel, start)[0] == "ok"
    status, text, prompts, errors = run(kernel, BG)
    assert status == "ok" and prompts == [], (text, errors, prompts)
    # another cell runs meanwhile and finishes: past the job's 3 s timeout and 1 s stall, on purpose
    status, text, prompts, errors = run(kernel, "import time\ntime.sleep(4)\nprint('other', 6 * 7)")
    assert status == "ok" and "other 42" in text and prompts == [], (text, errors)
    status, text, _, errors = run(kernel, "bp.wait(60)\nprint(bp.state)\nprint(bp.describe())")
    assert status == "ok", errors
    assert text.startswith("paused\njob 'bp': paused, "), text
    assert "; rank 1 at a breakpoint, Cell In[2]:5 (<module>) (timeout and stall watch suspended; attach with %dist_debug bp or " \
        "job.debug())" in text, text
    # waiting on it would last until someone attaches: %dist_wait says so at once
    status, text, prompts, errors = run(kernel, "%dist_wait bp")
    assert status == "error" and prompts == [], (text, errors)
    assert errors[0].startswith("JobPausedError: job 'bp' is paused: rank 1 at a breakpoint, "
                                "Cell In[2]:5"), errors
    assert "Attach with %dist_debug bp (or job.debug()): c continues the job, q ends it." in \
        errors[0]
    status, text, prompts, errors = run(kernel, "%dist_debug bp", ["p x", "n", "p y", "c"])
    assert status == "ok", (text, errors)
    assert prompts == ["(Pdb rank 1) "] * 4
    assert text.startswith("nbdist: attached to rank 1 of job 'bp', at a breakpoint (Cell In[2]:5")
    assert "(5)<module>()\n-> y = x + 1\n42\n" in text  # p x: the rank's own value
    assert "(6)<module>()\n-> t = torch.ones(1)\n43\n" in text  # n, then p y
    assert text.endswith("nbdist: rank 1 left pdb; job 'bp' runs on (%dist_wait bp waits for "
                         "it).\n"), text
    status, text, _, errors = run(kernel, "%dist_wait -q bp\nprint(bp.result())")
    assert status == "ok" and text == "[422.0, 432.0]\n", (text, errors)  # after the all_reduce
    assert run(kernel, "g.stop()")[0] == "ok"


def test_q_in_dist_debug_ends_the_background_job_with_an_error(kernel):
    assert run(kernel, "%load_ext nbdist\n%dist_start -n 2 --debug detail")[0] == "ok"
    status, text, _, _ = run(kernel, "%%dist\nimport os\n"
                                     "print(os.environ['TORCH_DISTRIBUTED_DEBUG'])")
    assert status == "ok" and "DETAIL" in text, text  # --debug detail reached the ranks
    assert run(kernel, "%%dist --bg bq\nz = 5\nif rank == 1:\n    breakpoint()\nz")[0] == "ok"
    assert run(kernel, "bq.wait(60)\nprint(bq.state)")[1] == "paused\n"
    status, text, prompts, errors = run(kernel, "%dist_debug bq", ["p z", "q"])
    assert status == "ok" and prompts == ["(Pdb rank 1) "] * 2, (text, errors)
    assert "\n5\nnbdist: rank 1 left pdb; job 'bq' ends with an error (pdb quit)" in text, text
    status, text, _, errors = run(kernel, "%dist_wait bq")
    assert status == "error" and "pdb was quit (q) on rank 1: the call ended there" in \
        errors[0], errors
    status, text, _, _ = run(kernel, "%dist_debug bq")  # IPython prints a UsageError
    assert status == "error" and text.startswith(
        "UsageError: job 'bq' is not at a breakpoint (it is failed): a breakpoint() in a "
        "background job pauses it there, and %dist_jobs then shows it as paused"), text


def test_a_breakpoint_where_the_kernel_has_no_stdin_continues_saying_so(kernel):
    """nbclient (a docs build) runs cells without stdin: the prompt cannot open, the call goes on."""
    assert run(kernel, "%load_ext nbdist\n%dist_start -n 2")[0] == "ok"
    status, text, prompts, errors = run(kernel, "%%dist\nif rank == 1:\n    breakpoint()\nrank",
                                        stdin=False)
    assert status == "ok" and prompts == [], (text, errors)
    assert "nbdist: rank 1's pdb cannot prompt here (StdinNotImplementedError: " in text, text
