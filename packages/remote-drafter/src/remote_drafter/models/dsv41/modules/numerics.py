"""How the drafter computes, shared by its modules: the model's dtype, the wider dtype its
reductions use (float32; float64 in a float64 model), the config's eps, and who runs the
round's small operations (the Triton kernels once they have matched torch, else torch)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from remote_drafter.models import pick
from remote_drafter.models.cuda_graphs import bucket_for

from ..config import Dsv41DrafterConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             wide: torch.dtype) -> torch.Tensor:
    h = x.to(wide)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h if weight is None else h * weight.to(wide)).to(x.dtype)


def inv_frequencies(theta: float, dims: int, device) -> torch.Tensor:
    """RoPE's inverse frequencies [dims / 2], float32, as vLLM builds them."""
    return 1.0 / theta ** (torch.arange(0, dims, 2, device=device, dtype=torch.float32) / dims)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, dims: int,
         wide: torch.dtype, inverse: bool = False) -> torch.Tensor:
    """GPT-J (interleaved pairs) rotation of x's last `dims` dims; positions broadcast to
    x.shape[:-1]. inverse=True rotates back (the attention output). The cos/sin table is
    float32 whatever x's dtype, as vLLM builds it (DeepseekV4ScalingRotaryEmbedding)."""
    angles = positions.to(torch.float32)[..., None] * inv_frequencies(theta, dims, x.device)
    cos, sin = angles.cos().to(wide), angles.sin().to(wide)
    if inverse:
        sin = -sin
    rot = x[..., -dims:].to(wide)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)
    return torch.cat([x[..., :-dims], turned.to(x.dtype)], -1)


def swiglu(x: torch.Tensor, w1, w3, w2, limit: float | None) -> torch.Tensor:
    """SiluAndMulWithClamp: silu(min(gate, limit)) * clamp(up, -limit, limit), then down;
    w1, w3, w2 are linears (callables x -> x @ W.T)."""
    gate, up = w1(x), w3(x)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return w2(F.silu(gate) * up)


def attention(q: torch.Tensor, ctx: torch.Tensor, new: torch.Tensor, unseen: torch.Tensor,
              sink: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """q [B, W, H, D] over the keys (which are the values) ctx [B, C, D] and new [B, W, D], less
    those `unseen` [B, C + W], a sink logit per head [H] beside them -> [B, W, H, D] in q's dtype."""
    b, w, heads, d = q.shape
    keys = torch.cat([ctx.to(q.dtype), new], 1).to(wide)  # [B, C+W, D]
    scores = torch.einsum("bwhd,bkd->bhwk", q.to(wide), keys) * d ** -0.5
    scores = scores.masked_fill(unseen[:, None, None, :], float("-inf"))
    sink = sink.view(1, heads, 1, 1).expand(b, heads, w, 1)
    probs = torch.cat([scores, sink.to(wide)], -1).softmax(-1)[..., :-1]
    return torch.einsum("bhwk,bkd->bwhd", probs, keys).to(q.dtype)


def relative_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """The largest difference relative to want's largest value."""
    return float((want.float() - got.float()).abs().max() / want.float().abs().max().clamp(min=1e-30))


def differs(want: torch.Tensor, got: torch.Tensor, tolerance: float) -> str | None:
    """How a kernel's result differs from torch's `want` past `tolerance` (relative_error), or None."""
    err = relative_error(want, got)
    return None if err <= tolerance else f"differs from torch's by {err:.2e} (relative to its largest value)"


class Numerics:
    """dtype, wide, eps, and `kernels` (the module kernels.py, or None: torch), which
    Dsv41Model.use_kernels sets for every module at once, the attention kernel apart."""

    def __init__(self, config: Dsv41DrafterConfig, dtype: torch.dtype, device: torch.device):
        self.config, self.dtype, self.device = config, dtype, device
        self.wide = torch.float64 if dtype == torch.float64 else torch.float32
        self.kernels = None
        self.attention_refusal: str | None = None  # why the attention kernel does not serve beside the others
        # the attention kernel's form by the batches it was chosen at (names of
        # kernels.ATTEND_VARIANTS; Dsv41Model.choose_attention): a batch takes the smallest at or
        # above it, else the largest's; None (not chosen) or {}: the kernel's defaults
        self.attend_chosen: dict[int, str] | None = None
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # RoPE's, per device, for the kernels

    @property
    def rounding(self) -> float:
        """How far another order of summation may move a result, relative to its largest
        value: float32 rounding; two bf16 steps in bf16 (what follows a bf16 value inherits them)."""
        return 1e-5 if self.dtype == torch.float32 else 2 ** -6

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """rms_norm with the config's eps (a kernel where they serve)."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps, self.wide)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., D] at positions [...] (x.shape[:-1], or x.shape[:-2]: one position shared
        by a row's heads), its last qk_rope_head_dim dims rotated (a kernel where they serve)."""
        c = self.config
        if self.kernels is not None:
            inv_freq = self._inv_freq.get(x.device)
            if inv_freq is None:  # made once (a graph's warm-up runs before its capture)
                inv_freq = self._inv_freq[x.device] = inv_frequencies(c.rope_theta, c.qk_rope_head_dim, x.device)
            return self.kernels.rope(x, positions, inv_freq, inverse)
        if positions.dim() < x.dim() - 1:
            positions = positions[..., None]
        return rope(x, positions, c.rope_theta, c.qk_rope_head_dim, self.wide, inverse)

    def top_two(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] (+ bias [B, V], any float dtype, added in `wide`) -> (the two likeliest tokens'
        probabilities [B, 2], the tokens [B, 2]): a greedy draft is the first. The kernel adds
        the bias as it reads the logits (no sum written and read back)."""
        if self.kernels is not None:
            return self.kernels.top_two(logits, bias)
        return pick.top_two(logits if bias is None else logits + bias.to(self.wide))

    def attend(self, q: torch.Tensor, ctx: torch.Tensor, new: torch.Tensor, unseen: torch.Tensor,
               sink: torch.Tensor) -> torch.Tensor:
        """attention() (a kernel where the kernels serve and it matched torch too)."""
        if self.kernels is not None and self.attention_refusal is None:
            chosen = self.attend_chosen
            name = chosen[bucket_for(chosen, len(q), max(chosen))] if chosen else "default"
            return self.kernels.attend(q, ctx, new, unseen, sink, **self.kernels.ATTEND_VARIANTS[name])
        return attention(q, ctx, new, unseen, sink, self.wide)

    def mixes(self, fn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """fn . x * rsqrt(mean(x^2) + eps) over the whole stream x [..., K*H], in `wide`."""
        x = residual.flatten(-2).to(self.wide)
        return (x @ fn.T) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)

    def collapse(self, residual: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """residual [..., K, H] weighted by pre [..., K] -> [..., H]."""
        return (pre[..., None] * residual.to(self.wide)).sum(-2).to(residual.dtype)
