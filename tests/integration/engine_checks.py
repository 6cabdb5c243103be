"""Checks every engine's group passes the same way (tests/integration/test_engine_*.py): the
magics with a background job and its stacks, and a Lightning fit. One copy, so the engines are held
to the same behaviour."""
import time

import pytest

LIGHTNING = '''
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
'''


def magic_cell_job_and_stacks(g, job_name):
    """``%%dist`` on the group, then a ``--bg`` job whose stacks show it in ``nap()``; the job is
    ended whatever happens, so a module's shared group stays usable. The magics are loaded into
    IPython's test shell unless another module's shell has them already (then left as they are)."""
    from IPython.testing import globalipapp
    from IPython.testing.globalipapp import start_ipython
    from IPython.utils.capture import capture_output

    from nbdist.ui import magics

    shell = start_ipython() or globalipapp.get_ipython()
    shell.display_formatter.active_types = shell.display_formatter.format_types
    loaded = "nbdist" in shell.extension_manager.loaded
    if not loaded:
        shell.run_line_magic("load_ext", "nbdist")
    before = magics.current_group()
    job = None
    try:
        magics.use_group(g)
        with capture_output() as out:
            shell.run_cell("%%dist\nprint('hello from', rank)\nrank * 3")
        assert [o.data.get("text/plain") for o in out.outputs] == ["Out[rank 0]: 0",
                                                                  "Out[rank 1]: 3"]
        assert "hello from" in out.stdout
        job = shell.run_cell_magic("dist", f"--bg {job_name} -q",
                                   "import time\ndef nap():\n    time.sleep(3)\nnap()\nrank")
        time.sleep(1.0)
        stacks = g.stacks(timeout=10)
        assert all(line.endswith(" nap") for line in stacks.summary().splitlines()), \
            stacks.summary()
        assert job.result(timeout=60) == [0, 1]
    finally:
        if job is not None and not job.done():  # the module's group stays usable for the rest
            job.interrupt()
            job.wait(timeout=30)
        magics.use_group(before)
        if not loaded:
            shell.run_line_magic("unload_ext", "nbdist")


def lightning_fit_one_epoch(g, tmp_path):
    """A plain ``Trainer`` fit of 16 samples for one epoch on the group: two steps on each rank."""
    pytest.importorskip("pytorch_lightning")
    import nbdist.lightning as nl

    nb = {"__name__": "__main__"}
    exec(LIGHTNING, nb)
    results = nl.fit(g, nb["Tiny"], nb["make_data"], "ddp", max_epochs=1, logger=False,
                     default_root_dir=str(tmp_path), enable_progress_bar=False,
                     enable_checkpointing=False, enable_model_summary=False)
    assert [(r.rank, r.global_step) for r in results] == [(0, 2), (1, 2)]
