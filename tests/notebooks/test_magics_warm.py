"""Lightning imported on the ranks once the kernel imports it (``nbdist.lightning.warm``), through
IPython's own post-cell event and real ranks."""
import pytest

from nbdist.lightning import warmup as warm

pytestmark = pytest.mark.timeout(120)

BEGUN = "import sys\n'pytorch_lightning' in sys.modules"


def test_after_the_kernel_imports_lightning_the_idle_groups_import_it_too(shell, magic_group):
    pytest.importorskip("pytorch_lightning")
    warm.AUTO = True
    try:
        shell.run_cell("x = 1")  # Lightning already imported in this process: warmed here
        assert [v for v in magic_group.exec(BEGUN)] == [True, True]
        job = magic_group.submit_exec("import time\ntime.sleep(1.0)")
        assert warm.warm_groups() == []  # busy: left alone, tried again after a later cell
        job.result(timeout=30)
        assert warm.warm_groups() == [magic_group]  # warmed already: no call
        magic_group.restart()
        assert magic_group.exec(BEGUN) == [False, False]
        shell.run_cell("y = 2")
        assert magic_group.exec(BEGUN) == [True, True]  # fresh ranks warmed again
    finally:
        warm.AUTO = False


def test_a_cell_that_imports_lightning_has_the_ranks_import_it_meanwhile(shell, magic_group):
    pytest.importorskip("pytorch_lightning")
    warm.AUTO = True
    try:
        shell.user_ns["g"] = magic_group
        shell.run_cell("import pytorch_lightning as pl\nseen = g.exec(%r)" % BEGUN)
        assert shell.user_ns["seen"] == [True, True]  # before the cell ran: warmed by its text
    finally:
        warm.AUTO = False


def test_the_trigger_is_off_with_auto_false(shell, magic_group):
    shell.run_cell("x = 1")
    assert magic_group.exec(BEGUN) == [False, False]


def test_a_lightning_the_ranks_lack_gives_a_note_not_a_broken_cell(shell, magic_group,
                                                                    monkeypatch, caplog):
    import logging
    import sys
    import types

    from nbdist.runtime import current

    monkeypatch.setattr(current, "_notes_said", set())
    caplog.set_level(logging.INFO, logger="nbdist")  # outside a kernel a note is a log record

    monkeypatch.delitem(sys.modules, "pytorch_lightning", raising=False)
    monkeypatch.setitem(sys.modules, "lightning", types.ModuleType("lightning"))
    monkeypatch.setitem(sys.modules, "lightning.pytorch", types.ModuleType("lightning.pytorch"))
    monkeypatch.setattr(warm, "AUTO", True)
    result = shell.run_cell("z = 3")
    assert result.success and shell.user_ns["z"] == 3
    err = caplog.text
    assert ("nbdist: could not import Lightning on the ranks ahead of the first fit (RemoteError: "
            in err and "fit() will import it when it runs." in err)
    assert magic_group.run(lambda: 1) == [1, 1]
