"""Wrong arguments to %dist_mem and %dist_bench: each message names the option, says what it
expects with an example, and ends in the usage line; nothing runs on the ranks."""
import pytest
import torch
from IPython.core.error import UsageError

pytestmark = pytest.mark.timeout(120)

WORLD_SIZES = ("argument --world-sizes: expected world sizes separated by commas, e.g. 8,64,512; "
               "got")
STRATEGIES = ("argument --strategies: expected strategy names separated by commas, e.g. "
              "ddp,zero1,fsdp")

MODEL = ("--model takes mlp:LAYERSxWIDTH (e.g. mlp:4x2236), a parameter count (e.g. 7.5B), or "
         "the name of a notebook function that builds the model")

BAD = [
    ("dist_mem", "--model 7.5B --world-sizes x", f"{WORLD_SIZES} 'x'"),
    ("dist_mem", "--model 7.5B --world-sizes 8,,64", f"{WORLD_SIZES} '8,,64'"),
    ("dist_mem", "--model 7.5B --world-sizes 0,8", f"{WORLD_SIZES} '0,8'"),
    ("dist_mem", "--model 7.5B --world-sizes 8.5", f"{WORLD_SIZES} '8.5'"),
    ("dist_mem", "--model 7.5B --strategies ,", f"{STRATEGIES}; got ','"),
    ("dist_mem", "--model 7.5B --strategies ddp,nope",
     "argument --strategies: 'nope' not found in the strategy registry. Available names: ddp, "),
    ("dist_mem", "--steps x", "argument --steps: expected a positive int, got 'x'"),
    ("dist_mem", "--steps 0", "argument --steps: expected a positive int, got '0'"),
    ("dist_mem", "--batch 1.5", "argument --batch: expected a positive int, got '1.5'"),
    ("dist_mem", "--model mlp:2x8 --tp 2", "--tp, --pp, --transformer, --sequence-parallel and "
     "--microbatches apply to the estimate of a parameter count (e.g. --model 7.5B)"),
    ("dist_mem", "--model get_ipython", "--model get_ipython: the notebook's get_ipython cannot "
     "be sent to the ranks (it cannot be pickled: "),
    ("dist_mem", "--model get_ipython", MODEL),
    ("dist_mem", "--model a_module", "--model a_module: the notebook's a_module is a model "
     "(Linear), not a function that builds one"),
    ("dist_mem", "--model a_number", "--model a_number: the notebook's a_number is an int, not a "
     "function that builds the model"),
    ("dist_mem", "--model a_number", MODEL),
    ("dist_bench", "--iters x", "argument --iters: expected a positive int, got 'x'"),
    ("dist_bench", "--iters 0", "argument --iters: expected a positive int, got '0'"),
    ("dist_bench", "--warmup -1", "argument --warmup: expected an int of at least 0, got '-1'"),
    ("dist_bench", "--warmup many", "argument --warmup: expected an int of at least 0, got 'many'"),
    ("dist_bench", "--sizes -4K", "argument --sizes: a size must be a positive number of bytes, "
     "got '-4K'"),
    ("dist_bench", "--sizes=-4K,1M", "argument --sizes: a size must be a positive number of "
     "bytes, got '-4K'"),
    ("dist_bench", "--sizes 4K-1K", "argument --sizes: the size range '4K-1K' goes down"),
    ("dist_bench", "--sizes 1024G", "the largest size, 1024 GiB, does not fit in memory"),
]


@pytest.mark.parametrize("name,line,message", BAD)
def test_wrong_values_name_the_option_and_give_an_example(shell, dist_group, name, line, message):
    shell.user_ns.update(a_module=torch.nn.Linear(2, 2), a_number=7)
    with pytest.raises(UsageError) as info:
        shell.run_line_magic(name, line)
    assert message in str(info.value)
    assert str(info.value).splitlines()[-1].startswith(f"usage: %{name}")
    assert dist_group.state == "ready"
