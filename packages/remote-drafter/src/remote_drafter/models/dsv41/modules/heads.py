"""The drafter's heads, at the last stage: the target's head over the normed hidden state,
the Markov head (logits_i = z_i + W2 W1[x_{i-1}], left to right) and the confidence head
(sigmoid(proj [h_i ; W1[x_{i-1}]]))."""

from __future__ import annotations

import torch

from .module import Module, Weights
from .numerics import Numerics


class Head(Module):
    """h [..., H] -> z [..., V] in `wide`: the head (dense or EXL3) over norm(h)."""

    def __init__(self, numerics: Numerics, weights: Weights, stage: str):
        super().__init__(numerics)
        self.norm_weight = self.take(weights, f"{stage}.norm.weight")
        self.proj = self.linear(weights, "head.weight")

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        num = self.numerics
        return self.proj(num.norm(h, self.norm_weight)).to(num.wide)


class MarkovHead(Module):
    """The Markov head's factors: the embedding W1 [V, r] and the head W2 [V, r]."""

    def __init__(self, numerics: Numerics, weights: Weights, names: tuple[str, str]):
        super().__init__(numerics)
        self.w1, self.w2 = (self.take(weights, n) for n in names)

    def embed(self, previous: torch.Tensor) -> torch.Tensor:
        """previous tokens [B] -> m [B, r]."""
        return self.w1[previous]

    def bias(self, m: torch.Tensor) -> torch.Tensor:
        """m [B, r] -> what the head adds to the base logits, [B, V] (in the weights' dtype)."""
        return m @ self.w2.T

    def logits(self, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return z + self.bias(m).to(self.numerics.wide)


class ConfidenceHead(Module):
    """h [..., H], m [..., r] -> [...] in (0, 1) (a round's every step at once: [B, W])."""

    def __init__(self, numerics: Numerics, weights: Weights, name: str):
        super().__init__(numerics)
        self.proj = self.take(weights, name)

    def __call__(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.cat([h, m], -1).to(self.numerics.wide) @ self.proj.T)[..., 0]
