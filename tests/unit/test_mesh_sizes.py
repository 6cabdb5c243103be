"""``nbdist.strategies.mesh_sizes``: the one place the mesh strategies' default sizes live (the
wrap functions, the launcher's labels and ``%dist_ui mesh`` all read it)."""
import pytest

from nbdist.parallel import MeshLayout
from nbdist.strategies import available_strategies, mesh_sizes


@pytest.mark.parametrize("world, expected", [
    (1, {"tp": {"tp": 1}, "fsdp2+tp": {"dp": 1, "tp": 1}, "hsdp": {"dp_replicate": 1, "dp_shard": 1},
         "pp": {"pp": 1}}),
    (2, {"tp": {"tp": 2}, "fsdp2+tp": {"dp": 1, "tp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 1},
         "pp": {"pp": 2}}),
    (3, {"tp": {"tp": 3}, "fsdp2+tp": {"dp": 1, "tp": 3}, "hsdp": {"dp_replicate": 1, "dp_shard": 3},
         "pp": {"pp": 3}}),
    (4, {"tp": {"tp": 4}, "fsdp2+tp": {"dp": 2, "tp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 2},
         "pp": {"pp": 4}}),
    (8, {"tp": {"tp": 8}, "fsdp2+tp": {"dp": 4, "tp": 2}, "hsdp": {"dp_replicate": 2, "dp_shard": 4},
         "pp": {"pp": 8}}),
])
def test_default_mesh_of_each_strategy(world, expected):
    for name, sizes in expected.items():
        assert mesh_sizes(name, world) == sizes
        assert list(sizes) == list(mesh_sizes(name, world))  # outermost first
        assert MeshLayout(world, **sizes).sizes == sizes  # a layout torch would build
    for name in available_strategies():
        if name not in expected:
            assert mesh_sizes(name, world) is None, name


def test_size_options_and_their_errors():
    assert mesh_sizes("fsdp2+tp", 4, tp=4) == {"dp": 1, "tp": 4}
    assert mesh_sizes("hsdp", 8, dp_shard=2, reshard_after_forward=False) == {
        "dp_replicate": 4, "dp_shard": 2}  # the strategy's other options are ignored here
    with pytest.raises(ValueError, match=r"strategy 'fsdp2\+tp': tp=3 does not divide the 4 "
                                         r"ranks; valid tp sizes for 4 ranks: 1, 2, 4"):
        mesh_sizes("fsdp2+tp", 4, tp=3)
    with pytest.raises(ValueError, match="strategy 'hsdp': dp_shard=3 does not divide the 4 ranks"):
        mesh_sizes("hsdp", 4, dp_shard=3)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        mesh_sizes("tp", 0)
