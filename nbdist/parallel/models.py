"""A small GPT-style transformer block written the way tensor parallel needs it.

:func:`nbdist.parallel.auto_plan` recognises it (and blocks named like it): attention with
separate ``q``/``k``/``v``/``o`` Linear layers whose forward reshapes with ``self.n_heads`` (divided
by tp when the plan is applied) and ``-1`` for the width, an MLP ``Sequential(Linear, GELU,
Linear)``, pre-norms.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    """Causal self-attention: ``q``, ``k``, ``v``, ``o`` Linear layers, ``n_heads`` heads."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} must be a multiple of n_heads={n_heads}")
        self.n_heads = n_heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (lin(x).view(b, s, self.n_heads, -1).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))  # -1: the local width under tp


class TransformerBlock(nn.Module):
    """A pre-norm GPT block on ``(batch, seq, dim)``: ``x + attn(ln1(x))``, then
    ``x + mlp(ln2(x))`` with ``mlp = Sequential(fc1, GELU, fc2)`` (``hidden`` wide, default 4 x dim).

    Tensor parallel splits ``n_heads`` and ``hidden`` over tp ranks (both must divide);
    ``sequence_parallel=True`` splits the sequence in the norms, too.
    """

    def __init__(self, dim: int = 64, n_heads: int = 4, hidden: int = 0, dropout: float = 0.0):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden or 4 * dim), nn.GELU(),
                                 nn.Linear(hidden or 4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))
