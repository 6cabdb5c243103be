"""The magics in a real IPython kernel (issue 26): ipykernel and pyzmq's Windows wheels run under
Wine, so on Windows this drives the Windows python.exe's own kernel through jupyter_client. (nbclient
cannot run there: nbformat needs jsonschema, whose rpds extension does not load under Wine 8, "DLL
load failed while importing rpds"; jupyter_client alone is enough to run cells.) On Linux it runs
the same cells with the Windows paths: spawned workers and output through pipes.

One kernel, one group: %load_ext (which warms the spares), %dist_start, %%dist with per-rank output
and a collective, a rank's error, %dist_push / %dist_pull, %dist_status, %dist_restart (taking the
warm spares), %dist_stop.
"""
import os
import sys

import pytest

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def kernel():  # per test: the leak check runs after the kernel (and its helpers) ended
    from jupyter_client.manager import KernelManager

    env = dict(os.environ, NBDIST_START_METHOD="spawn", NBDIST_STREAMS="pipe")
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env)
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=300)
        yield client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
        manager.cleanup_resources()


def run(client, code):
    """Run ``code`` in the kernel: (status, what it printed, errors as "Name: value")."""
    out, errors = [], []

    def hook(msg):
        c, kind = msg["content"], msg["msg_type"]
        if kind == "stream":
            out.append(c["text"])
        elif kind in ("execute_result", "display_data"):
            out.append(c["data"].get("text/plain", "") + "\n")
        elif kind == "error":
            errors.append(f"{c['ename']}: {c['evalue']}")

    reply = client.execute_interactive(code, output_hook=hook, timeout=500)
    return reply["content"]["status"], "".join(out), errors


# jupyter_client on Windows runs zmq on the Proactor event loop and says so; nothing to act on
@pytest.mark.filterwarnings("ignore:Proactor event loop does not implement add_reader")
def test_the_magics_run_a_group_in_a_real_kernel(kernel):
    status, _, errors = run(kernel, "%load_ext nbdist")
    assert status == "ok", errors
    status, out, errors = run(kernel, "%dist_start -n 2")
    assert status == "ok" and "started 2 ranks (backend gloo, device cpu)" in out, (out, errors)

    status, out, errors = run(kernel, "%%dist\nimport torch, torch.distributed as dist\n"
                                      "t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\n"
                                      "print('sum', rank, t.tolist())")
    assert status == "ok", errors
    assert "[rank 0] sum 0 [3.0, 3.0]" in out and "[rank 1] sum 1 [3.0, 3.0]" in out, out

    status, out, errors = run(kernel, "%%dist\nif rank == 1:\n    raise ValueError('bad shard')")
    assert status == "error" and any("bad shard" in e for e in errors), (out, errors)
    assert "rank 1" in " ".join(errors) + out

    status, out, errors = run(kernel, "import torch\nw = torch.arange(4.0)\n%dist_push w")
    assert status == "ok", errors
    run(kernel, "%%dist\nw = w * (rank + 1)")
    status, out, errors = run(kernel, "%dist_pull w\nprint([x.tolist() for x in w])")
    assert status == "ok", errors
    assert "[[0.0, 1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]]" in out, out

    status, out, errors = run(kernel, "%dist_status")
    assert status == "ok" and "ready" in out, (out, errors)

    # the spares topped up after the start: all of them spawned (a loaded machine spawns the
    # second well after the first is kept) and done importing
    status, out, errors = run(kernel, "import time\nfrom nbdist.runtime import spares\n"
                                      "until = time.monotonic() + 300\n"
                                      "while not (spares.settle(5) and spares.ready(timeout=5) >= 2)"
                                      " and time.monotonic() < until:\n"
                                      "    time.sleep(0.1)\n"
                                      "kept = set(spares.pids()) if spares.ready() >= 2 else None\n"
                                      "%dist_restart")
    assert status == "ok", (out, errors)
    status, out, errors = run(kernel, "import os, nbdist\n"
                                      "print(kept is not None and set(nbdist.current_group().run("
                                      "os.getpid)) <= kept)")
    assert status == "ok" and out.strip().endswith("True"), (out, errors)

    status, out, errors = run(kernel, "%dist_stop")
    assert status == "ok" and "group stopped" in out, (out, errors)

