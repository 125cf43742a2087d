"""The transformer pieces the target model and the DSpark drafter share (Llama-style:
RMSNorm, rotary positions in the Hugging Face convention, grouped-query attention, SwiGLU).
Attribute names follow Hugging Face Llama checkpoints so state dicts load as they are."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding; x [B, heads, T, d], positions [B, T] (absolute token positions)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None, :, None] * inv  # [B, 1, T, d/2]
    cos, sin = torch.cos(angles).repeat(1, 1, 1, 2), torch.sin(angles).repeat(1, 1, 1, 2)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return (x.float() * cos + half.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Queries from `x`, keys and values from `kv` (the same tensor for self-attention;
    [context; block] in the drafter). `allowed` [B, Tq, Tk] is True where a query may look."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, theta: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, hidden // heads, theta
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, kv, q_pos, kv_pos, allowed):
        b, tq, tk = x.shape[0], x.shape[1], kv.shape[1]
        q = self.q_proj(x).view(b, tq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(kv).view(b, tk, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(kv).view(b, tk, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, q_pos, self.theta), rotate(k, kv_pos, self.theta)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = (torch.softmax(scores, dim=-1) @ v.float()).to(x.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(b, tq, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, eps: float, theta: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, theta)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x, q_pos, allowed, context=None, ctx_pos=None):
        """Self-attention when `context` is None; else keys/values are [context; x]."""
        h = self.input_layernorm(x)
        kv, kv_pos = (h, q_pos) if context is None else (torch.cat([context, h], 1),
                                                         torch.cat([ctx_pos, q_pos], 1))
        x = x + self.self_attn(h, kv, q_pos, kv_pos, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))
