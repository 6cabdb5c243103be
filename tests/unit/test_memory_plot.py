"""The memory bars on made-up records (no processes): names that fit stay on one line, names
that would run into each other alternate between two, none broken."""
import matplotlib
import pytest

from nbdist.memory import MemoryRecord

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from nbdist.ui.plots.memory import plot_memory  # noqa: E402

pytestmark = pytest.mark.timeout(30)
MIB = 1 << 20


def records(names, ranks=2):
    return [MemoryRecord(name, rank, ranks, "cpu", MIB, 4 * MIB, 4 * MIB, 8 * MIB, 0, 0, None,
                         None, None, {}, estimate=16 * MIB)
            for name in names for rank in range(ranks)]


def pads(ax):
    return [tick.get_pad() for tick in ax.xaxis.get_major_ticks()]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_five_short_names_stay_on_one_line():
    """Tutorial 04's five strategies: its figure had zero1 and fsdp a line lower, for no
    crowding at all (issue 35's review)."""
    ax = plot_memory(records(["ddp", "zero1", "fsdp_grad_op", "fsdp", "fsdp2"]))
    assert len(set(pads(ax))) == 1
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "ddp", "zero1", "fsdp_grad_op", "fsdp", "fsdp2"]


def test_long_names_side_by_side_alternate_lines_whole():
    names = ["fairscale_sharded", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3",
             "fairscale_oss", "fsdp_grad_op", "zero1", "fsdp"]
    ax = plot_memory(records(names, ranks=1))
    first, second = pads(ax)[0::2], pads(ax)[1::2]
    assert len(set(first)) == len(set(second)) == 1 and second[0] > first[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == names  # whole, not broken at "_"
