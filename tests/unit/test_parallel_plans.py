"""nbdist.parallel without ranks: mesh layouts and their errors, automatic plans, plan checks (#19)."""
import pytest
import torch
from torch import nn

from nbdist import parallel
from nbdist.parallel import MeshLayout, auto_plan, check_plan, factorizations


def test_layout_is_row_major_like_torch():
    layout = MeshLayout(4, dp=2, tp=2)
    assert layout.names == ("dp", "tp") and layout.shape == (2, 2)
    assert layout.groups("tp") == [[0, 1], [2, 3]]  # neighbours share a tp group
    assert layout.groups("dp") == [[0, 2], [1, 3]]
    assert layout.coords(3) == {"dp": 1, "tp": 1} and layout.rank(dp=1, tp=0) == 2
    flat = torch.arange(8).reshape(2, 2, 2)  # what init_device_mesh does with the ranks
    three = MeshLayout(8, pp=2, dp=-1, tp=2)
    assert three.sizes == {"pp": 2, "dp": 2, "tp": 2}
    for rank in range(8):
        c = three.coords(rank)
        assert flat[c["pp"], c["dp"], c["tp"]] == rank
    assert three.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_layout_text_and_html():
    text = str(MeshLayout(4, dp=2, tp=2))
    assert text.splitlines() == [
        "mesh dp=2 x tp=2 over 4 ranks (row-major: the last dimension is the innermost)",
        "      tp=0  tp=1",
        "dp=0     0     1",
        "dp=1     2     3",
        "groups along dp: [0, 2] [1, 3]",
        "groups along tp: [0, 1] [2, 3]"]
    assert "pp=1:" in str(MeshLayout(8, pp=2, dp=2, tp=2))
    html = MeshLayout(4, dp_replicate=2, dp_shard=2)._repr_html_()
    assert "<table" in html and "rank 3" in html and "groups along <b>dp_shard</b>" in html
    assert repr(MeshLayout(3)) == "MeshLayout(3, dp=3)"  # no size: the whole world is dp
    assert MeshLayout(2, dp=2, tp=1).sizes == {"dp": 2, "tp": 1}  # a named size-1 dim stays


def test_factorizations():
    assert factorizations(4) == [{"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4}]
    assert len(factorizations(8, ("pp", "dp", "tp"))) == 10
    assert factorizations(1) == [{"dp": 1}]


@pytest.mark.parametrize("sizes,text", [
    (dict(tp=3), "mesh sizes tp=3 do not fit 4 ranks: the sizes must multiply to the world size "
     "(their product is 3). Valid for 4 ranks over dp, tp: dp=4; dp=2, tp=2; tp=4 (-1 takes the "
     "ranks left over, e.g. dp=-1)"),
    (dict(dp=-1, tp=3), "(the other sizes multiply to 3, which does not divide 4)"),
    (dict(dp=-1, tp=-1), "only one mesh size may be -1 (the ranks left over), got -1 for dp and "
     "tp"),
    (dict(dp=0), "mesh size dp=0 must be a positive int, or -1 for the ranks left over"),
    (dict(dp=2, dp_shard=2), "give dp (one data-parallel dimension) or dp_replicate and dp_shard "
     "(HSDP: replicas of sharded groups), not both"),
])
def test_bad_mesh_sizes_list_what_fits(sizes, text):
    with pytest.raises(ValueError) as info:
        MeshLayout(4, **sizes)
    assert text in str(info.value)


def test_layout_lookups_explain_mistakes():
    layout = MeshLayout(4, dp=2, tp=2)
    with pytest.raises(ValueError, match="rank 4 is not in a world of 4 ranks"):
        layout.coords(4)
    with pytest.raises(ValueError, match="give an index for each of dp, tp, got dp"):
        layout.rank(dp=1)
    with pytest.raises(ValueError, match=r"tp=2 is outside 0\.\.1"):
        layout.rank(dp=0, tp=2)
    with pytest.raises(ValueError, match="this mesh has no dimension 'pp'; it has dp, tp"):
        layout.groups("pp")
    with pytest.raises(ValueError, match="unknown mesh dimension 'cp'; nbdist's mesh dimensions "
                                         "are pp, dp, dp_replicate, dp_shard, tp"):
        parallel.layout.resolve_sizes(4, cp=2)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        MeshLayout(0)


def test_device_mesh_outside_the_ranks():
    with pytest.raises(RuntimeError, match=r"device_mesh\(\) needs torch.distributed initialised: "
                                           "call it on the ranks"):
        parallel.device_mesh(dp=1)


def test_plot_draws_every_rank():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from nbdist.ui.plots.mesh import plot_mesh

    ax = MeshLayout(8, pp=2, dp=2, tp=2).plot()
    texts = [t.get_text() for t in ax.texts]
    assert all(f"rank {r}" in texts for r in range(8))
    assert "pp=1" in texts and ax.get_title() == "mesh pp=2 x dp=2 x tp=2 over 8 ranks"
    with pytest.raises(TypeError, match="plot_mesh\\(\\) draws a nbdist.parallel.MeshLayout, "
                                        "got dict"):
        plot_mesh({"dp": 2})
    matplotlib.pyplot.close("all")


def _styles(plan):
    return {k: type(v).__name__ for k, v in plan.items()}


def test_auto_plan_pairs_linear_layers_and_leaves_the_odd_one_replicated():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 8), nn.Dropout(), nn.Linear(8, 4), nn.Linear(4, 2))
    assert _styles(auto_plan(model)) == {"0": "ColwiseParallel", "2": "RowwiseParallel",
                                         "4": "ColwiseParallel", "6": "RowwiseParallel"}
    odd = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(),
                        nn.Linear(8, 2))  # 0 has no partner (a LayerNorm follows it)
    assert _styles(auto_plan(odd)) == {"2": "ColwiseParallel", "4": "RowwiseParallel"}


def test_auto_plan_for_transformer_blocks_with_and_without_sequence_parallel():
    model = nn.Sequential(parallel.TransformerBlock(16, 4), nn.LayerNorm(16), nn.Linear(16, 4))
    assert _styles(auto_plan(model)) == {
        "0.attn.q": "ColwiseParallel", "0.attn.k": "ColwiseParallel",
        "0.attn.v": "ColwiseParallel", "0.attn.o": "RowwiseParallel",
        "0.mlp.0": "ColwiseParallel", "0.mlp.2": "RowwiseParallel"}
    sp = auto_plan(model, sequence_parallel=True)
    assert _styles(sp) == {
        "0": "PrepareModuleInputOutput", "0.ln1": "SequenceParallel",
        "0.ln2": "SequenceParallel", "0.attn": "PrepareModuleInput",
        "0.attn.q": "ColwiseParallel", "0.attn.k": "ColwiseParallel",
        "0.attn.v": "ColwiseParallel", "0.attn.o": "RowwiseParallel",
        "0.mlp": "PrepareModuleInput", "0.mlp.0": "ColwiseParallel",
        "0.mlp.2": "RowwiseParallel"}
    assert "Shard(dim=1)" in repr(sp["0.attn.o"])  # reduce-scatter back to the sequence shards
    assert "0.attn.o: RowwiseParallel(" in parallel.describe(sp)


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16)


class Llamaish(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(8), nn.RMSNorm(8)
        self.attention = nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self.attention, name, nn.Linear(8, 8, bias=False))
        self.attention.n_heads = 2
        self.feed_forward = SwiGLU()


def test_auto_plan_knows_common_names_and_torch_encoder_layers():
    assert _styles(auto_plan(Llamaish(), sequence_parallel=True)) == {
        "": "PrepareModuleInputOutput", "attention_norm": "SequenceParallel",
        "ffn_norm": "SequenceParallel", "attention": "PrepareModuleInput",
        "attention.wq": "ColwiseParallel", "attention.wk": "ColwiseParallel",
        "attention.wv": "ColwiseParallel", "attention.wo": "RowwiseParallel",
        "feed_forward": "PrepareModuleInput", "feed_forward.w1": "ColwiseParallel",
        "feed_forward.w3": "ColwiseParallel", "feed_forward.w2": "RowwiseParallel"}
    layer = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)
    assert _styles(auto_plan(layer)) == {
        "layers.0.linear1": "ColwiseParallel", "layers.0.linear2": "RowwiseParallel",
        "layers.1.linear1": "ColwiseParallel", "layers.1.linear2": "RowwiseParallel"}


@pytest.mark.parametrize("model,sp,text", [
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2)), False,
     "auto_plan found nothing to shard in Sequential: it knows nn.Sequential stacks of nn.Linear, "
     "attention modules with q/k/v/o Linear layers, MLP modules (fc1/fc2, w1/w2/w3, ...) and "
     "nn.TransformerEncoderLayer's feed-forward. The parameters here sit in 0 (Conv2d), 2 "
     "(Linear). To split them, pass your own plan: plan={'fc1': ColwiseParallel(), 'fc2': "
     "RowwiseParallel()}"),
    (nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), True,
     "sequence_parallel=True needs transformer blocks, and Sequential has none"),
    (nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1), True,
     "sequence_parallel=True cannot shard 'layers.0.self_attn' (nn.MultiheadAttention): it packs "
     "q, k and v into one in_proj_weight"),
])
def test_auto_plan_names_what_it_cannot_handle(model, sp, text):
    with pytest.raises(ValueError) as info:
        auto_plan(model, sequence_parallel=sp)
    assert text in str(info.value)
    assert "strategies.wrap('tp', model, make_optimizer, plan=plan)" in str(info.value)


def test_auto_plan_and_the_block_refuse_bad_arguments():
    with pytest.raises(TypeError, match=r"auto_plan\(\) takes an nn.Module, got object"):
        auto_plan(object())
    with pytest.raises(ValueError, match="dim=10 must be a multiple of n_heads=4"):
        parallel.TransformerBlock(10, 4)


def test_check_plan_names_the_layer_and_its_size():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    check_plan(model, auto_plan(model), 2)  # 6 output features split over 2: fine
    with pytest.raises(ValueError, match=r"tp=4 does not divide layer '0' \(Linear\(in_features="
                                         r"4, out_features=6, bias=True\)\): ColwiseParallel "
                                         r"splits its 6 output features over 4 ranks\. Choose a "
                                         r"tp that divides 6, or leave '0' out of the plan"):
        check_plan(model, auto_plan(model), 4)
    with pytest.raises(ValueError, match="RowwiseParallel splits its 4 input features over 3"):
        check_plan(model, {"0": RowwiseParallel()}, 3)
    with pytest.raises(ValueError, match="ColwiseParallel splits its 5 embedding dimension"):
        check_plan(nn.Embedding(10, 5), {"": ColwiseParallel()}, 2)
    with pytest.raises(ValueError, match="plan key 'fc9' names no module of Sequential; its "
                                         "modules are: 0, 1, 2"):
        check_plan(model, {"fc9": ColwiseParallel()}, 2)
    with pytest.raises(TypeError, match=r"plan\['0'\] must be a ParallelStyle \(ColwiseParallel"
                                        r"\(\), RowwiseParallel\(\), SequenceParallel\(\), "
                                        r"\.\.\.\), got str"):
        check_plan(model, {"0": "colwise"}, 2)
    with pytest.raises(TypeError, match="plan must be a dict {module name: ParallelStyle}"):
        check_plan(model, [ColwiseParallel()], 2)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 heads of 'attention' "
                                         r"\(Module.n_heads\): each rank must hold whole heads"):
        check_plan(Llamaish(), auto_plan(Llamaish()), 4)
    wild = nn.Sequential(*[nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)) for _ in range(2)])
    check_plan(wild, {"*.0": ColwiseParallel(), "*.1": RowwiseParallel()}, 2)  # torch's fnmatch


def test_tensor_parallel_refuses_a_plan_and_sequence_parallel_together():
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(ValueError, match="sequence_parallel=True writes the plan itself; with "
                                         "plan= given, put SequenceParallel"):
        parallel.tensor_parallel(nn.Linear(2, 2), None, {"": ColwiseParallel()},
                                 sequence_parallel=True)


def test_doctor_says_context_parallel_is_not_offered():
    lines = parallel.meshes.doctor_lines()
    assert lines[0].startswith("parallelism: device meshes, tensor + sequence parallel (tp), "
                               "fsdp2+tp, hsdp on cpu (gloo)")
    assert "context parallel: not offered" in lines[1] and "does not run on CPU" in lines[1]
