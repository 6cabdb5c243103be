"""Activation memory of a transformer under tensor, sequence and pipeline parallelism.

The per-layer formulas are those of Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (Megatron-LM; sec. 4, eq. 1-4 and Table 2), in bytes per transformer
layer, with s the sequence length, b the micro-batch size, h the hidden size, a the attention
heads and t the tensor-parallel size::

    no parallelism                 s·b·h·(34 + 5·a·s/h)
    tensor parallel (t)            s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel     s·b·h·(34/t + 5·a·s/(h·t))
    + selective recomputation      the same without the 5·a·s/(h·t) term (attention scores,
                                   softmax and its dropout are recomputed)
    full recomputation             2·s·b·h (only each layer's input is kept)

The paper's assumptions, which :class:`Transformer` activations inherit: 16-bit activations (2
bytes an element; the dropout masks 1 byte), the MLP 4h wide, attention that stores its s x s
scores, softmax and dropout mask (no FlashAttention: that is the 5·a·s/h term), one layer =
attention + MLP + two layer norms. Embeddings, the final norm, the output layer and the loss are
not counted (the paper's sec. 4.3 adds them; they are small for many layers).

Pipelines (sec. 4.2.3): a stage holds L/pp layers. Under 1F1B the first stage keeps the
activations of pp microbatches in flight (fewer when there are fewer microbatches), so it holds
about L layers' worth whatever pp is; under GPipe every stage keeps all m microbatches. Without a
pipeline one microbatch is in flight (gradient accumulation runs them one after the other).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

RECOMPUTE = (None, "selective", "full")
SCHEDULES = ("1f1b", "gpipe")
SOURCE = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer "
          "Models, sec. 4 and Table 2")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class Transformer:
    """The shape of a GPT-style transformer, for activation estimates.

    ``layers`` L, ``hidden`` h, ``heads`` a, ``seq_len`` s, ``micro_batch`` b (samples per
    microbatch, per data-parallel rank).
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int = 1

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq_len", "micro_batch"):
            _positive(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads} "
                             "(each head is hidden/heads wide)")


def per_layer(shape: Transformer, tp: int = 1, sequence_parallel: bool = False,
              recompute: Optional[str] = None) -> Fraction:
    """Bytes of activations one transformer layer keeps for backward, per the paper's Table 2."""
    s, b, h, a, t = shape.seq_len, shape.micro_batch, shape.hidden, shape.heads, tp
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be None, 'selective' or 'full', got {recompute!r}")
    if recompute == "full":
        return Fraction(2 * s * b * h)
    scores = Fraction(0) if recompute == "selective" else Fraction(5 * a * s, h * t)
    if sequence_parallel:
        return s * b * h * (Fraction(34, t) + scores)
    return s * b * h * (10 + Fraction(24, t) + scores)


def formula_text(tp: int, sequence_parallel: bool, recompute: Optional[str]) -> str:
    """The per-layer formula used, as text."""
    if recompute == "full":
        return "2sbh (full recomputation)"
    scores = "" if recompute == "selective" else " + 5as/(ht)"
    body = f"34/t{scores}" if sequence_parallel else f"10 + 24/t{scores}"
    return (f"sbh({body})" + (" (selective recomputation)" if recompute else "")
            + f", t={tp}" + (", sequence parallel" if sequence_parallel else ""))


def check(shape: Transformer, tp: int, pp: int, sequence_parallel: bool) -> None:
    """Raise ``ValueError`` when tp or pp does not fit the transformer's shape."""
    if shape.heads % tp:
        valid = [d for d in range(1, shape.heads + 1) if shape.heads % d == 0]
        raise ValueError(f"tp={tp} does not divide the {shape.heads} attention heads: Megatron-LM "
                         f"gives each tensor-parallel rank whole heads. Valid tp for "
                         f"{shape.heads} heads: {', '.join(map(str, valid))}")
    if sequence_parallel and shape.seq_len % tp:
        raise ValueError(f"sequence_parallel=True splits the sequence over tp={tp} ranks, and "
                         f"tp does not divide seq_len={shape.seq_len}")
    if shape.layers % pp:
        valid = [d for d in range(1, shape.layers + 1) if shape.layers % d == 0]
        raise ValueError(f"pp={pp} does not divide the {shape.layers} layers into equal stages "
                         f"(as Megatron-LM requires). Valid pp for {shape.layers} layers: "
                         f"{', '.join(map(str, valid))}")


def in_flight(pp: int, microbatches: Optional[int], schedule: str) -> int:
    """Microbatches whose activations the first stage holds at once."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)} for the activation "
                         f"estimate, got {schedule!r}")
    if microbatches is not None:
        _positive("microbatches", microbatches)
    if pp == 1:
        return 1
    if schedule == "gpipe":
        if microbatches is None:
            raise ValueError("schedule='gpipe' keeps every microbatch in flight: pass "
                             "microbatches=")
        return microbatches
    return pp if microbatches is None else min(pp, microbatches)


def activations(shape: Transformer, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                recompute: Optional[str] = None, microbatches: Optional[int] = None,
                schedule: str = "1f1b") -> tuple:
    """``(bytes on the first pipeline stage's ranks, the assumptions as text)``."""
    check(shape, tp, pp, sequence_parallel)
    layer = per_layer(shape, tp, sequence_parallel, recompute)
    stage_layers, flight = shape.layers // pp, in_flight(pp, microbatches, schedule)
    total = math.ceil(layer * stage_layers * flight)
    s, b, h, a = shape.seq_len, shape.micro_batch, shape.hidden, shape.heads
    text = (f"activations: {formula_text(tp, sequence_parallel, recompute)} = "
            f"{math.ceil(layer):,} B per layer (s={s}, b={b}, h={h}, a={a}) x {stage_layers} "
            f"layers per stage (L={shape.layers}, pp={pp}) x {flight} microbatch"
            f"{'es' if flight > 1 else ''} in flight ("
            + ("no pipeline" if pp == 1 else f"{schedule}, first stage") + f") ({SOURCE}; "
            "16-bit activations, 1-byte dropout masks, MLP 4h, attention scores stored; "
            "embeddings, output layer and loss not counted)")
    return total, text


_KEYS = {"L": "layers", "h": "hidden", "a": "heads", "s": "seq_len", "b": "micro_batch"}


def transformer_spec(text: str) -> Transformer:
    """``"L=32,h=4096,a=32,s=2048,b=1"`` (``b`` optional) -> a :class:`Transformer`."""
    values = {}
    for item in (x.strip() for x in str(text).split(",") if x.strip()):
        key, _, value = item.partition("=")
        if key.strip() not in _KEYS or not value.strip().isdigit():
            raise ValueError(f"--transformer takes L=LAYERS,h=HIDDEN,a=HEADS,s=SEQ_LEN[,b=MICRO_"
                             f"BATCH] (e.g. L=32,h=4096,a=32,s=2048,b=1), got {text!r}")
        values[_KEYS[key.strip()]] = int(value)
    missing = [k for k, v in _KEYS.items() if v not in values and k != "b"]
    if missing:
        raise ValueError(f"--transformer {text!r} lacks {', '.join(missing)} (L=LAYERS,h=HIDDEN,"
                         "a=HEADS,s=SEQ_LEN[,b=MICRO_BATCH])")
    return Transformer(**values)


def estimate_options(tp=None, pp=None, transformer=None, sequence_parallel=False,
                     recompute=None, microbatches=None, schedule="1f1b") -> dict:
    """The command-line options of ``nbdist mem`` / ``%dist_mem`` as :func:`estimate` keywords
    (only those given; ``transformer`` as text for :func:`transformer_spec`)."""
    out = {k: v for k, v in dict(tp=tp, pp=pp, recompute=recompute,
                                 microbatches=microbatches).items() if v is not None}
    if transformer:
        out["transformer"] = transformer_spec(transformer)
        out["schedule"] = schedule
    if sequence_parallel:
        out["sequence_parallel"] = True
    return out
