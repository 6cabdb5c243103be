"""Running a cell in the test shell as a notebook would, for the magics tests (this directory is
on sys.path while they run)."""
from __future__ import annotations

import contextlib

from IPython.utils.capture import capture_output


def run(shell, cell):
    """Run ``cell`` as a notebook would; return (result, captured output)."""
    with capture_output() as captured:
        result = shell.run_cell(cell)
    return result, captured


def texts(captured):
    """The text/plain of every display() the cell made."""
    return [out.data.get("text/plain") for out in captured.outputs]


@contextlib.contextmanager
def autodist(shell, options=""):
    """``%autodist OPTIONS`` for the block, turned off after it whatever happens."""
    run(shell, f"%autodist {options}".rstrip())
    try:
        yield
    finally:
        run(shell, "%autodist")


def real_kernel():
    """A real kernel and its client (channels started, ready): ``(manager, client)``."""
    from jupyter_client import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
    except BaseException:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        raise
    return manager, client
