"""What the Lightning tests share (tests/integration, on sys.path while they run): the notebook's
namespace, a group prepared for Lightning, and one process trained on the batches Lightning deals
out to its data-parallel ranks."""
import contextlib

import torch

import nbdist


def notebook(source: str) -> dict:
    """The notebook's namespace: ``source`` run as ``__main__`` (so its classes travel by value)."""
    ns = {"__name__": "__main__"}
    exec(source, ns)
    return ns


@contextlib.contextmanager
def prepared_group(world_size: int, source: str, timeout: float = 60):
    """A gloo group with nbdist's Lightning guards (installed before Lightning is imported on the
    ranks: the import hook patches it) and ``source`` run on its ranks; stopped at the end."""
    import nbdist.lightning as nl

    with nbdist.start(world_size, backend="gloo", device="cpu", timeout=timeout) as group:
        nl.prepare(group)
        group.exec(source)
        yield group


def one_process_on_lightning_batches(nb: dict, dp: int, epochs: int = 2, batch: int = 8):
    """``nb["Toy"]`` trained by SGD (lr 0.05) in one process, each step on what the ``dp``
    data-parallel ranks see together: Lightning's DistributedSampler (shuffle, seed 0, set_epoch
    every epoch) deals ``nb["make_data"]()``'s dataset out to them. Returns the module."""
    from torch.utils.data import DataLoader, DistributedSampler

    ref = nb["Toy"]()  # RANK unset here: seed 0, as the modules seed themselves on every rank
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    data = nb["make_data"]().dataset
    samplers = [DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True) for r in range(dp)]
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        loaders = [DataLoader(data, batch_size=batch, sampler=s) for s in samplers]
        for parts in zip(*loaders):
            opt.zero_grad()
            ref.loss(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])).backward()
            opt.step()
    return ref
