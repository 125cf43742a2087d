"""The drafter round, staged: remote_drafter's own DSparkModel run in float64 (CPU) or
float32 (GPU, TF32 off), with every intermediate the native kernels produce read off it.

Not a second implementation: `DSparkModel.block_logits` itself runs, and forward hooks on
its submodules record what each sublayer computed. Only the attention probabilities, which
the torch module never keeps, are recomputed from the hooked q/k projections with
`remote_drafter.models.llama_layers.rotate`; a test checks that probabilities @ v reproduce the module's
own attention output. The Markov chain is DSparkDrafter.draft's at T = 0: previous token
x_0 = anchor, logits_i = z_i + W2 W1[x_{i-1}], x_i = argmax (first index on ties).

Stages, in the order they are computed (names are the gate's quantities):
  ctx              [B, C, hidden]  context projection Wc (before its RMSNorm)
  L{l}.ctx_kv      [B, C, 2 kv]    k | v projections of the normed context (before RoPE)
  L{l}.qkv         [B, W, q+2 kv]  q | k | v of the block's input-normed rows (before RoPE)
  L{l}.attn_probs  [B, H, W, C+W]  attention probabilities (stage zero: layer 0's)
  L{l}.attn        [B, W, q]       attention output, before o_proj
  L{l}.attn_resid  [B, W, hidden]  x + o_proj(attn)
  L{l}.mlp_act     [B, W, ffn]     silu(gate) * up of the post-attention-normed rows
  L{l}.out         [B, W, hidden]  the layer's output
  head.logits      [B, W, V]       z = norm(x) @ head^T
  markov.logits    [B, W, V]       z_i + W2 W1[x_{i-1}]
  draft.tokens     [B, W]          greedy drafts
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch

from remote_drafter.models.dspark import DSparkDrafter, DSparkModel
from remote_drafter.models.llama_layers import rotate


@dataclass
class RoundInputs:
    """One round for B requests, laid out as DSparkDrafter.draft lays them out."""
    ctx: torch.Tensor        # [B, C, F] float32 hidden rows (right-aligned in the window)
    ctx_valid: torch.Tensor  # [B, C] bool
    ctx_pos: torch.Tensor    # [B, C] int64
    anchor: torch.Tensor     # [B] int64: the newest committed token
    anchor_pos: torch.Tensor  # [B] int64: its position

    def to(self, device) -> RoundInputs:
        return RoundInputs(*(t.to(device) for t in (self.ctx, self.ctx_valid, self.ctx_pos,
                                                     self.anchor, self.anchor_pos)))

    @property
    def batch(self) -> int:
        return self.anchor.shape[0]


def inputs_from_requests(drafter: DSparkDrafter, requests) -> RoundInputs:
    """The drafter's own layout of a batch of DraftRequests (DSparkDrafter._context)."""
    ctx, valid, pos = drafter._context(requests)
    return RoundInputs(torch.from_numpy(ctx), torch.from_numpy(valid), torch.from_numpy(pos),
                       torch.tensor([int(r.history.tokens[-1]) for r in requests]),
                       torch.tensor([r.history.length - 1 for r in requests]))


def stage_names(num_layers: int) -> list[str]:
    per_layer = ("ctx_kv", "qkv", "attn_probs", "attn", "attn_resid", "mlp_act", "out")
    return (["ctx"] + [f"L{i}.{s}" for i in range(num_layers) for s in per_layer]
            + ["head.logits", "markov.logits", "draft.tokens"])


def as_dtype(model: DSparkModel, dtype: torch.dtype) -> DSparkModel:
    """A copy of `model` (weights, embedding and head) in `dtype`; the original is untouched."""
    return copy.deepcopy(model).to(dtype).eval()


@torch.no_grad()
def staged_round(model: DSparkModel, inputs: RoundInputs) -> dict[str, torch.Tensor]:
    """Every stage of one greedy round, computed by `model` in its own dtype (pass a
    float64 copy from as_dtype for the CPU reference)."""
    c, rec, hooks = model.config, {}, []
    b, n_ctx, w = inputs.batch, inputs.ctx_valid.shape[1], c.block_size

    def keep(name):
        def hook(module, args, output=None):
            rec[name] = (args[0] if output is None else output).detach().clone()
        return hook

    hooks.append(model.ctx_proj.register_forward_hook(keep("ctx")))
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(a, proj).register_forward_hook(keep(f"L{i}.{proj}")))
        hooks.append(a.o_proj.register_forward_pre_hook(keep(f"L{i}.attn")))
        hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(keep(f"L{i}.attn_resid")))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(keep(f"L{i}.mlp_act")))
        hooks.append(layer.register_forward_hook(keep(f"L{i}.out")))
    hooks.append(model.norm.register_forward_hook(keep("normed")))
    try:
        model.block_logits(inputs.ctx, inputs.ctx_valid, inputs.ctx_pos, inputs.anchor, inputs.anchor_pos)
    finally:
        for h in hooks:
            h.remove()

    block_pos = inputs.anchor_pos[:, None] + torch.arange(w, device=inputs.anchor.device)
    kv_pos = torch.cat([inputs.ctx_pos, block_pos], 1)
    allowed = torch.cat([inputs.ctx_valid, inputs.ctx_valid.new_ones(b, w)], 1)
    out = {"ctx": rec["ctx"]}
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        q, k, v = rec.pop(f"L{i}.q_proj"), rec.pop(f"L{i}.k_proj"), rec.pop(f"L{i}.v_proj")
        out[f"L{i}.ctx_kv"] = torch.cat([k[:, :n_ctx], v[:, :n_ctx]], -1)
        out[f"L{i}.qkv"] = torch.cat([q, k[:, n_ctx:], v[:, n_ctx:]], -1)
        # Attention.forward's scores, kept: [B, H, W, C+W]
        qh = rotate(q.view(b, w, a.heads, a.head_dim).transpose(1, 2), block_pos, a.theta)
        kh = rotate(k.view(b, n_ctx + w, a.kv_heads, a.head_dim).transpose(1, 2), kv_pos, a.theta)
        kh = kh.repeat_interleave(a.heads // a.kv_heads, dim=1)
        scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(a.head_dim)
        out[f"L{i}.attn_probs"] = torch.softmax(scores.masked_fill(~allowed[:, None, None], float("-inf")), -1)
        for s in ("attn", "attn_resid", "mlp_act", "out"):
            out[f"L{i}.{s}"] = rec[f"L{i}.{s}"]
    z = rec["normed"] @ model.head.T
    out["head.logits"] = z
    logits, tokens, previous = [], [], inputs.anchor
    for i in range(w):
        logits.append(z[:, i] + model.markov.w2(model.markov.w1(previous)))
        previous = logits[-1].argmax(-1)
        tokens.append(previous)
    out["markov.logits"] = torch.stack(logits, 1)
    out["draft.tokens"] = torch.stack(tokens, 1)
    return out


def top2_gap(logits: torch.Tensor) -> np.ndarray:
    """Top-1 minus top-2 logit per row (what a near tie means: ARCHITECTURE.md § Exactness)."""
    top = logits.double().topk(2, dim=-1).values
    return (top[..., 0] - top[..., 1]).cpu().numpy()
