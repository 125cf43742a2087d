"""A drafter layer's attention: sliding window over [context rows ; block], the whole block
seen both ways, a sink logit per head; V4 also RMS-norms each query head. The context rows
are this layer's key/value rows of committed positions (post kv_norm and RoPE), computed
once per position (context_rows) and kept by the drafter's windows."""

from __future__ import annotations

import torch

from .module import Module, Weights
from .numerics import Numerics


def unseen_keys(ctx_valid: torch.Tensor, block: int) -> torch.Tensor:
    """The keys no block row sees, [B, C + block], from the context's valid rows [B, C]: the
    context's padding (the whole block sees itself, both ways). Once a round, for every layer."""
    return ~torch.cat([ctx_valid, ctx_valid.new_ones(len(ctx_valid), block)], 1)


class Attention(Module):
    def __init__(self, numerics: Numerics, weights: Weights, prefix: str):
        super().__init__(numerics)
        c, p = numerics.config, prefix + "attn."
        self.wq_a, self.wq_b = self.linear(weights, p + "wq_a.weight"), self.linear(weights, p + "wq_b.weight")
        self.q_norm = self.take(weights, p + "q_norm.weight")
        self.wkv, self.kv_norm = self.linear(weights, p + "wkv.weight"), self.take(weights, p + "kv_norm.weight")
        self.sink = self.take(weights, p + "attn_sink")
        self.wo_a = self.groups(weights, p + "wo_a.weight", c.o_groups)
        self.wo_b = self.linear(weights, p + "wo_b.weight")

    def context_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Key/value rows [N, D] of the context (the projected taps) or of the block input."""
        num = self.numerics
        return num.rope(num.norm(self.wkv(x), self.kv_norm), positions)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                 unseen: torch.Tensor) -> torch.Tensor:
        """x [B, W, H] at positions [B, W] over ctx [B, C, D] and the block's own rows, less
        the keys `unseen` [B, C + W] (unseen_keys) -> [B, W, H]."""
        num = self.numerics
        c = num.config
        b, w, _ = x.shape
        q = self.wq_b(num.norm(self.wq_a(x), self.q_norm)).view(b, w, c.num_attention_heads, c.head_dim)
        if c.q_head_norm:
            q = num.norm(q, None)
        q = num.rope(q, positions)
        o = num.attend(q, ctx, self.context_rows(x, positions), unseen, self.sink)
        o = num.rope(o, positions, inverse=True).reshape(b, w, c.o_groups, -1)
        return self.wo_b(self.wo_a(o).flatten(-2))
