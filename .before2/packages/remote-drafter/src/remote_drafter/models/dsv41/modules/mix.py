"""The hyper-connection mix (mHC): the stream is K residual copies [..., K, H]; around each
sublayer a Sinkhorn-normalised K x K matrix mixes them, and the sublayer's input is the
copies collapsed. Delayed mHC (V4.1): a sublayer's input is collapsed with the PREVIOUS
sublayer's pre weight (V4: its own); the drafter's output is collapsed with the last FFN's
(V4: a learned hc_head, OutputCollapse)."""

from __future__ import annotations

import torch

from ..config import HC_POST_ALPHA
from .module import Module, Weights
from .numerics import Numerics, rms_norm


class HyperMix(Module):
    """The mix around sublayer `mixer` ("attn" or "ffn") of the layer under `prefix`."""

    def __init__(self, numerics: Numerics, weights: Weights, prefix: str, mixer: str):
        super().__init__(numerics)
        self.fn, self.scale, self.base = (self.take(weights, f"{prefix}hc_{mixer}_{p}")
                                          for p in ("fn", "scale", "base"))
        self.norm_weight = self.take(weights, f"{prefix}{mixer}_norm.weight")

    def pre(self, residual: torch.Tensor, carried_pre: torch.Tensor | None):
        """residual [..., K, H] -> (the sublayer's normed input [..., H], post [..., K],
        comb [..., K, K], pre [..., K]); carried_pre is the previous sublayer's pre (None:
        layer 0's attention, which takes copy 0)."""
        num = self.numerics
        c, k = num.config, num.config.hc_mult
        if num.kernels is not None:
            kernels = num.kernels
            collapse = (kernels.COLLAPSE_OWN if not c.delayed_mhc else
                        kernels.COLLAPSE_FIRST if carried_pre is None else kernels.COLLAPSE_CARRIED)
            return kernels.hc_pre(residual, self.fn, self.scale, self.base, carried_pre, collapse, self.norm_weight,
                                  c.rms_norm_eps, c.hc_eps, HC_POST_ALPHA, c.hc_sinkhorn_iters)
        mixes, scale, base = num.mixes(self.fn, residual), self.scale, self.base
        pre = torch.sigmoid(mixes[..., :k] * scale[0] + base[:k]) + c.hc_eps
        post = torch.sigmoid(mixes[..., k:2 * k] * scale[1] + base[k:2 * k]) * HC_POST_ALPHA
        comb = mixes[..., 2 * k:].unflatten(-1, (k, k)) * scale[2] + base[2 * k:].view(k, k)
        comb = comb.softmax(-1) + c.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (comb.sum(-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        collapse_with = carried_pre if c.delayed_mhc else pre  # V4: no delay
        collapsed = residual[..., 0, :] if collapse_with is None else num.collapse(residual, collapse_with)
        return rms_norm(collapsed, self.norm_weight, c.rms_norm_eps, num.wide), post, comb, pre

    def post(self, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
        """residual = comb^T residual + post x out."""
        num = self.numerics
        if num.kernels is not None:
            return num.kernels.hc_post(out, residual, post, comb)
        mixed = torch.einsum("...ij,...ih->...jh", comb, residual.to(num.wide))
        return (mixed + post[..., None] * out[..., None, :].to(num.wide)).to(residual.dtype)


class OutputCollapse(Module):
    """V4's hc_head at the last stage: the output copies' collapse weights, learned
    (fn [K, K*H], base [K], scale [1])."""

    def __init__(self, numerics: Numerics, weights: Weights, names: tuple[str, str, str]):
        super().__init__(numerics)
        self.fn, self.base, self.scale = (self.take(weights, n) for n in names)

    def __call__(self, residual: torch.Tensor) -> torch.Tensor:
        num = self.numerics
        return torch.sigmoid(num.mixes(self.fn, residual) * self.scale[0] + self.base) + num.config.hc_eps
