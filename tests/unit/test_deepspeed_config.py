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


class Accelerator:
    """An accelerator answering as DeepSpeed's would on some machine (a stub: this checks nbdist's
    own precision check, not DeepSpeed). DeepSpeed's cpu accelerator says fp16 is supported on a
    CPU with avx512_fp16 / AMX-FP16 and not elsewhere, so both answers are tested here."""

    def __init__(self, name="cpu", fp16=False, bf16=False):
        self.name, self.fp16, self.bf16 = name, fp16, bf16

    def device_name(self):
        return self.name

    def is_fp16_supported(self):
        return self.fp16

    def is_bf16_supported(self):
        return self.bf16


CPU_FP16 = ("fp16={'enabled': True} is refused on a CPU group, whatever fp16 support this CPU has: "
            "DeepSpeed's fp16 mode is made for GPUs (its loss scaling needs engine.backward(loss), "
            "not the usual loss.backward()). Use precision='bf16-mixed' instead (bf16 keeps fp32's "
            "range: no loss scaling), or precision='fp32'")


@pytest.mark.parametrize("key,accelerator,text", [
    ("bf16", Accelerator(), "bf16 does not work here: DeepSpeed's cpu accelerator has no bf16 "
     "support. Use precision='fp32' instead"),
    ("fp16", Accelerator("cuda"), "fp16 does not work here: DeepSpeed's cuda accelerator has no "
     "fp16 support. Use precision='bf16-mixed' instead"),
    ("fp16", Accelerator("cpu", fp16=False), CPU_FP16),
    ("fp16", Accelerator("cpu", fp16=True, bf16=True), CPU_FP16),  # a Xeon with avx512_fp16
])
def test_a_precision_that_does_not_work_is_refused(key, accelerator, text):
    with pytest.raises(ValueError) as info:
        deepspeed._check_precision({key: {"enabled": True}}, accelerator)
    assert str(info.value) == text
    deepspeed._check_precision({key: {"enabled": False}}, accelerator)  # fp32: nothing to refuse


def test_fp16_where_the_gpu_accelerator_has_it_is_left_to_deepspeed():
    deepspeed._check_precision({"fp16": {"enabled": True}}, Accelerator("cuda", fp16=True))


@pytest.mark.parametrize("answers,words", [
    (dict(accelerator="cpu", bf16=True, fp16=False), "bf16"),
    (dict(accelerator="cpu", bf16=True, fp16=True), "bf16, fp16 -- fp16 is refused on a CPU group "
     "whatever the CPU: use bf16"),
    (dict(accelerator="cuda", bf16=True, fp16=True), "bf16, fp16"),
    (dict(accelerator="cuda", bf16=False, fp16=False), "none"),
])
def test_the_doctor_says_which_half_precisions_work_whatever_deepspeed_reports(answers, words):
    from nbdist.strategies.deepspeed_doctor import _precisions

    assert _precisions(answers) == words
