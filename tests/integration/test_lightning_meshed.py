"""The mesh strategies through ``nbdist.lightning.fit`` on 4 ranks (issue 19): ``fsdp2+tp`` on a
2 x 2 mesh trains like one process on the same batches; ``hsdp`` and ``pp``, which Lightning cannot
run, are refused before anything runs. (``tp`` on 2 ranks: test_lightning.py.)"""
import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")
import nbdist.lightning as nl  # noqa: E402

from lightning_cells import (notebook, one_process_on_lightning_batches,  # noqa: E402,I001
                             prepared_group)
from test_lightning import SOURCE  # noqa: E402

# FSDP2 over Lightning's "data_parallel" dimension on top of tensor parallel over
# "tensor_parallel"; the same start on every rank, as TensorParallel.
SOURCE_2D = SOURCE + '''
class TwoD(TensorParallel):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        from nbdist.parallel import tensor_parallel
        tensor_parallel(self.net, self.device_mesh["tensor_parallel"])
        dp = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=dp)
        fully_shard(self.net, mesh=dp)
'''

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def nb():
    return notebook(SOURCE_2D)


@pytest.fixture(scope="module")
def g4():
    """One 4-rank gloo group for the module, with the Lightning guards and the source on it."""
    with prepared_group(4, SOURCE_2D) as group:
        yield group


def test_fsdp2_tp_through_lightning_matches_one_process(g4, nb):
    """strategy="fsdp2+tp": ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2).
    Each data-parallel rank reads its half of the data (Lightning's DistributedSampler) and FSDP2
    averages the gradients over dp, so each step is one process's step on both halves' batches."""
    results = nl.fit(g4, nb["TwoD"], nb["make_data"], "fsdp2+tp", weights="all", max_epochs=2,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert [r.global_step for r in results] == [8] * 4  # 4 batches of 8 per dp rank, 2 epochs
    ref = one_process_on_lightning_batches(nb, dp=2)
    start = nb["Toy"]().state_dict()
    for state in (r.state_dict for r in results):
        for name, value in ref.state_dict().items():
            assert torch.allclose(state[name].float(), value, atol=1e-5), name
            assert not torch.allclose(state[name].float(), start[name], atol=1e-4), name  # trained


@pytest.mark.parametrize("name,advice", [
    ("hsdp", "nbdist.strategies.wrap('hsdp', model, make_optimizer) in a %%dist cell"),
    ("pp", "pipe = nbdist.parallel.pipeline(model, '1f1b', microbatches, loss_fn=...)")])
def test_fit_refuses_the_mesh_strategies_lightning_cannot_run(g4, nb, name, advice):
    with pytest.raises(ValueError) as info:
        nl.fit(g4, nb["TwoD"], nb["make_data"], name, max_epochs=1)
    text = str(info.value)
    assert text.startswith(f"strategy={name!r} (")
    assert ("Lightning's ModelParallelStrategy builds a data_parallel x tensor_parallel mesh only; "
            "through fit() nbdist offers strategy='fsdp2', 'tp' and 'fsdp2+tp' on it") in text
    assert advice in text
    assert g4.run(lambda: torch.distributed.get_world_size()) == [4] * 4  # nothing ran
