"""What goes into the drafter: the target's taps, projected once per committed position
(the context side), and the block a round drafts (the seed, then noise)."""

from __future__ import annotations

import torch

from .module import Module, Weights
from .numerics import Numerics


class TapProjection(Module):
    """taps [N, k*H] -> main_x [N, H]: main_norm(main_proj(taps)), at the first stage."""

    def __init__(self, numerics: Numerics, weights: Weights, stage: str):
        super().__init__(numerics)
        self.proj = self.linear(weights, f"{stage}.main_proj.weight")
        self.norm_weight = self.take(weights, f"{stage}.main_norm.weight")

    def __call__(self, taps: torch.Tensor) -> torch.Tensor:
        return self.numerics.norm(self.proj(taps.to(self.numerics.dtype)), self.norm_weight)


class BlockEmbedding(Module):
    """seed [B] -> (embeddings [B, W, H], block ids [B, W]: the seed, then noise)."""

    def __init__(self, numerics: Numerics, weights: Weights):
        super().__init__(numerics)
        self.weight = self.take(weights, "embed.weight")

    def __call__(self, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.numerics.config
        ids = torch.full((len(seed), c.block_size), c.noise_token_id, device=seed.device)
        ids[:, 0] = seed
        return self.weight[ids], ids
