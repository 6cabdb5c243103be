"""``%load_ext nbdist`` in a real kernel, stopped or interrupted at once: nothing on stderr.

``%load_ext nbdist`` starts the forkserver in the background; it then imports torch for a second
or two. Jupyter's "shut down" and "interrupt" send SIGINT to the kernel's whole process group,
which includes that forkserver.
"""
from __future__ import annotations

import time

import psutil
import pytest
from jupyter_client import KernelManager


def _sigint_handled(pid: int) -> bool:
    """Whether the process has set SIGINT to a handler or to "ignore" (a fresh process has
    neither: SIGINT would kill it silently; Python installs its handler at start-up)."""
    with open(f"/proc/{pid}/status") as status:
        masks = dict(line.split(":\t", 1) for line in status if line.startswith("Sig"))
    bit = 1 << (2 - 1)  # SIGINT is signal 2
    return bool((int(masks["SigCgt"], 16) | int(masks["SigIgn"], 16)) & bit)


def _forkserver(kernel: psutil.Process, timeout: float = 30.0) -> psutil.Process:
    """The kernel's forkserver process, once its Python has started (a SIGINT now would raise
    KeyboardInterrupt in it, or be ignored)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in kernel.children():
            try:
                if "multiprocessing.forkserver" in " ".join(child.cmdline()) and \
                        _sigint_handled(child.pid):
                    return child
            except (psutil.NoSuchProcess, FileNotFoundError):
                continue
        time.sleep(0.01)
    raise AssertionError(f"the kernel started no forkserver within {timeout} s")


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _run(client, code: str) -> dict:
    reply = client.execute_interactive(code, timeout=120, output_hook=lambda msg: None)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["shutdown", "interrupt"])
def test_stopping_the_kernel_right_after_load_ext_prints_no_traceback(tmp_path, how):
    log = tmp_path / "kernel.log"
    manager = KernelManager(kernel_name="python3")
    with open(log, "w") as out:
        manager.start_kernel(stdout=out, stderr=out, cwd=str(tmp_path))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        _run(client, "%load_ext nbdist")
        server = _forkserver(psutil.Process(manager.provisioner.pid))
        if how == "interrupt":  # while the forkserver imports torch
            manager.interrupt_kernel()
            time.sleep(0.5)
            assert _alive(server), "the interrupt killed the forkserver"
            _run(client, "%dist_start -n 2")  # workers come from that same forkserver
            _run(client, "%dist_stop")
            assert _alive(server)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)  # interrupts first, then asks the kernel to exit
    server.wait(60)  # it exits once the kernel is gone (after its imports)
    text = log.read_text()
    assert "Traceback" not in text, text
    if how == "shutdown":
        assert "KeyboardInterrupt" not in text, text


def test_the_shutdown_hook_stops_groups_first_and_never_blocks_the_shutdown(capfd, monkeypatch):
    """The wrapper %load_ext puts on ipykernel's do_shutdown (a real kernel's restart runs it:
    test_jobs_notebook.py): nbdist's groups stop and its helper processes end first; if that
    fails, the kernel still shuts down and its log says why."""
    import nbdist.ui.magics as magics

    calls = []

    class Kernel:  # what the hook needs of ipykernel's kernel: its do_shutdown
        def do_shutdown(self, restart):
            calls.append(("kernel", restart))
            return {"status": "ok", "restart": restart}

    kernel = Kernel()
    kernel.do_shutdown = magics._stopping_first(kernel.do_shutdown)
    wrapped = kernel.do_shutdown
    monkeypatch.setattr(magics, "stop_for_exit", lambda: calls.append("stop_for_exit"))
    monkeypatch.setattr(magics, "close_helpers", lambda: calls.append("close_helpers"))
    assert wrapped(True) == {"status": "ok", "restart": True}
    assert calls == ["stop_for_exit", "close_helpers", ("kernel", True)]

    def failing():
        raise RuntimeError("a rank would not stop")

    monkeypatch.setattr(magics, "stop_for_exit", failing)
    calls.clear()
    assert wrapped(False) == {"status": "ok", "restart": False}
    assert calls == [("kernel", False)]
    assert ("nbdist: stopping the groups before the kernel's shutdown failed: "
            "RuntimeError('a rank would not stop')") in capfd.readouterr().err
