"""The mesh panel and the launcher's mesh labels, driven from Python without a browser
(issue 19); the ``panels`` fixture: tests/notebooks/conftest.py."""
from __future__ import annotations

import pytest
from traitlets import TraitError

import nbdist
from nbdist.ui.widgets import launcher, mesh_panel

PNG = b"\x89PNG"


@pytest.mark.timeout(60)
def test_launcher_labels_the_mesh_strategies_with_their_sizes(panels):
    ui = panels(launcher, world_size=2, strategy="fsdp2+tp", refresh_interval=5.0)
    dropdown = ui._controls["strategy"]
    labels = dict((value, label) for label, value in dropdown.options)
    assert labels["ddp"] == "ddp" and labels["tp"] == "tp (tp 2)"
    assert labels["fsdp2+tp"] == "fsdp2+tp (dp 1 x tp 2)" and labels["pp"] == "pp (pp 2)"
    assert labels["hsdp"] == "hsdp (dp_replicate 2 x dp_shard 1)"
    assert "mesh on 2 ranks: <b>dp 1 x tp 2</b>" in ui._notes.value
    assert "dp of size 1: nothing is split along it on 2 ranks" in ui._notes.value

    ui._controls["world_size"].value = 4  # the labels follow; the choice stays the plain name
    labels = dict((value, label) for label, value in dropdown.options)
    assert labels["fsdp2+tp"] == "fsdp2+tp (dp 2 x tp 2)" and labels["tp"] == "tp (tp 4)"
    assert labels["hsdp"] == "hsdp (dp_replicate 2 x dp_shard 2)" and labels["pp"] == "pp (pp 4)"
    assert ui.strategy == "fsdp2+tp" and dropdown.value == "fsdp2+tp" and ui.error == ""
    assert "mesh on 4 ranks: <b>dp 2 x tp 2</b>" in ui._notes.value
    assert "nbdist.ui.mesh_panel(4, dp=2, tp=2)" in ui._notes.value
    assert "size 1" not in ui._notes.value
    ui.world_size = 3  # odd: fsdp2+tp is tp over all three, the label says so
    assert dropdown.label == "fsdp2+tp (dp 1 x tp 3)"
    dropdown.value = "ddp"
    assert ui.strategy == "ddp" and "mesh on" not in ui._notes.value


# ---- the mesh panel -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_mesh_panel_valid_invalid_and_the_picture(panels):
    mp = panels(mesh_panel)  # no group: 4 ranks, the dp x tp mesh fsdp2+tp builds
    assert mp.world_size == 4 and mp.sizes == {"dp": 2, "tp": 2} and mp.error == ""
    assert "valid: 4 ranks = dp 2 x tp 2" in mp._validity.value
    assert mp.layout.groups("tp") == [[0, 1], [2, 3]]
    assert "<td style='text-align:center'>rank 3</td>" in mp._table.value
    assert bytes(mp.figure.value).startswith(PNG)
    assert [b.description for b in mp._layouts.children] == [
        "pp 4", "pp 2 x dp 2", "pp 2 x tp 2", "dp 4", "dp 2 x tp 2", "tp 4"]

    mp._controls["tp"].value = 4  # dp 2 x tp 4 = 8: MeshLayout's error, in red, no picture
    assert mp.error.startswith("mesh sizes dp=2, tp=4 do not fit 4 ranks: the sizes must "
                               "multiply to the world size (their product is 8). Valid for 4 "
                               "ranks over dp, tp: dp=4; dp=2, tp=2; tp=4")
    assert "nbdist-error" in mp._feedback.value and "not valid" in mp._validity.value
    assert mp.layout is None and bytes(mp.figure.value) == b"" and mp._table.value == ""
    mp._layouts.children[2].click()  # a valid layout, one click
    assert mp.sizes == {"pp": 2, "tp": 2} and mp.error == ""
    assert mp._controls["dp"].value == "-" and mp._controls["pp"].value == 2
    assert "valid: 4 ranks = pp 2 x tp 2" in mp._validity.value
    assert bytes(mp.figure.value).startswith(PNG)

    mp.world_size = 8  # traits drive it too; HSDP instead of dp, -1 for the rest
    mp.choose({"pp": 2, "dp_replicate": -1, "dp_shard": 2})
    assert "valid: 8 ranks = pp 2 x dp_replicate 2 x dp_shard 2" in mp._validity.value
    assert "pp 2 x dp_replicate 2 x dp_shard 2" in [b.description for b in mp._layouts.children]
    mp.dp = 2
    assert mp.error == ("give dp (one data-parallel dimension) or dp_replicate and dp_shard "
                        "(HSDP: replicas of sharded groups), not both")
    with pytest.raises(TraitError, match="mesh size tp=0 must be a positive int, or -1"):
        mp.tp = 0
    with pytest.raises(ValueError, match="unknown mesh dimension 'cp'; nbdist's mesh dimensions"):
        mp.choose({"cp": 2})


@pytest.mark.timeout(120)
def test_mesh_panel_takes_the_current_groups_world_size(shared_group, panels):
    nbdist.use_group(shared_group)
    mp = panels(mesh_panel, tp=-1)
    assert mp.world_size == shared_group.world_size == 2
    assert mp.sizes == {"tp": -1} and mp.layout.sizes == {"tp": 2}
    assert "valid: 2 ranks = tp 2" in mp._validity.value


@pytest.mark.timeout(60)
def test_mesh_panel_shows_its_state_where_the_widget_cannot_run(panels):
    """Issue 35: a page that cannot run the widget showed an empty Out[] (or a repr of the
    children); the panel's bundle carries what it shows now, as text and static HTML."""
    mp = panels(mesh_panel)
    data = mp._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"] == "nbdist mesh panel (4 ranks): valid: 4 ranks = dp 2 x tp 2"
    page = data["text/html"]
    assert "valid: 4 ranks = dp 2 x tp 2" in page and "rank 3</td>" in page
    assert "<img src='data:image/png;base64," in page and "need a running kernel" in page
    mp.tp = 4
    data = mp._repr_mimebundle_()
    assert data["text/plain"].startswith("nbdist mesh panel (4 ranks): not valid: mesh sizes "
                                         "dp=2, tp=4 do not fit 4 ranks")
    assert "<img" not in data["text/html"] and "nbdist-error" in data["text/html"]
