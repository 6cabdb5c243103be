"""The DeepSpeed config nbdist builds (pure functions: no DeepSpeed, no ranks needed)."""
import pytest
import torch

from nbdist import memory
from nbdist.strategies import deepspeed


def test_options_merge_into_the_notebook_defaults_key_by_key():
    model = memory.mlp(2, 64)  # Ψ = 8,320, largest parameter 4,096
    config = deepspeed.build_config(3, model, "fp32", {"zero_optimization": {"reduce_bucket_size":
                                                                           100},
                                                       "gradient_clipping": 1.0})
    zero = config["zero_optimization"]
    assert zero == {"stage": 3, "reduce_bucket_size": 100, "allgather_bucket_size": 4096,
                    "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 4096,
                    "memory_efficient_linear": False}
    assert config["gradient_clipping"] == 1.0 and config["bf16"] == {"enabled": False}
    assert config["zero_allow_untested_optimizer"] is True
    assert deepspeed.build_config(1, model, "bf16-mixed", {})["bf16"] == {"enabled": True}
    assert "stage3_param_persistence_threshold" not in \
        deepspeed.build_config(2, model, "fp32", {})["zero_optimization"]


def test_buckets_scale_with_the_model_not_deepspeeds_2_gb_default():
    assert deepspeed.bucket_elements(memory.mlp(2, 64)) == 4096  # its largest parameter
    with torch.device("meta"):
        assert deepspeed.bucket_elements(memory.mlp(4, 2236)) == 5_001_932  # Ψ/4
        assert deepspeed.bucket_elements(torch.nn.Linear(50_000, 50_000)) == 500_000_000


def test_merge_replaces_what_is_not_a_dict():
    assert deepspeed.merge({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": 3}, "d": {"e": 1}}) == \
        {"a": {"b": 3, "c": 2}, "d": {"e": 1}}


@pytest.mark.parametrize("options,text", [
    (dict(fp16={"enabled": True}, bf16={"enabled": True}), "the options' bf16/fp16 sections "
     "disagree"),
    (dict(zero_optimization={"stage": 2}), "use the strategy 'deepspeed_zero2' instead"),
])
def test_conflicts_are_refused(options, text):
    with pytest.raises(ValueError, match=text):
        deepspeed.build_config(1, torch.nn.Linear(2, 2), "fp32", options)


class NoHalf:
    """An accelerator as DeepSpeed's would answer on a machine without fp16 or bf16 (a stub:
    this checks nbdist's own precision check, not DeepSpeed)."""

    def device_name(self):
        return "cpu"

    def is_fp16_supported(self):
        return False

    def is_bf16_supported(self):
        return False


@pytest.mark.parametrize("key,text", [
    ("bf16", "bf16 does not work here: DeepSpeed's cpu accelerator has no bf16 support. "
     "Use precision='fp32' instead"),
    ("fp16", "fp16 does not work here: DeepSpeed's cpu accelerator has no fp16 support. "
     "Use precision='bf16-mixed' instead"),
])
def test_a_precision_the_accelerator_lacks_is_refused(key, text):
    with pytest.raises(ValueError) as info:
        deepspeed._check_precision({key: {"enabled": True}}, NoHalf())
    assert str(info.value) == text
    deepspeed._check_precision({key: {"enabled": False}}, NoHalf())  # fp32: nothing to refuse
