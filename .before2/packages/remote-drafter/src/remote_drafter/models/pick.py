"""Turning one position's logits into a token for a batch of requests (shared by the
drafters that compute logits): argmax at T = 0, a seeded draw otherwise, plus what the
speculation cache ranks outcomes by (own probability, likeliest alternative)."""

from __future__ import annotations

import numpy as np
import torch

from remote_drafter.engine.sampling import draw, is_greedy

from .base import Draft


class Picker:
    """Collects one chain of positions for B requests; finish() returns host arrays."""

    def __init__(self, requests, want_probs: bool):
        self.requests, self.want_probs = requests, want_probs
        self.greedy = [is_greedy(r.temperature) for r in requests]
        self.temps = [1.0 if g else r.temperature for g, r in zip(self.greedy, requests)]
        self.tokens, self.top2_p, self.top2_i, self.own, self.full = [], [], [], [], []

    def __call__(self, logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """logits [B, V] (float32) for the tokens at `positions`; returns tokens [B] (device)."""
        temps = torch.tensor(self.temps, device=logits.device, dtype=torch.float32)[:, None]
        top_p, top_i = top_two(logits, temps)
        tokens, own = top_i[:, 0].clone(), top_p[:, 0]
        p = torch.softmax(logits.float() / temps, dim=-1) if self.want_probs or not all(self.greedy) else None
        if not all(self.greedy):
            host = p.cpu().numpy()
            for b, r in enumerate(self.requests):
                if not self.greedy[b]:
                    tokens[b] = draw(host[b], r.seed, positions[b])
            drawn = torch.tensor([not g for g in self.greedy], device=logits.device)
            own = torch.where(drawn, p.gather(1, tokens[:, None])[:, 0], own)
        self.tokens.append(tokens)
        self.top2_p.append(top_p)
        self.top2_i.append(top_i)
        self.own.append(own)
        if self.want_probs:
            self.full.append(p)
        return tokens

    def finish(self):
        """(tokens [B, D], probs [B, D, V] | None, own [B, D], alt_tokens [B, D], alt_probs [B, D])."""
        probs = torch.stack(self.full, 1).cpu().numpy().astype(np.float32) if self.want_probs else None
        return chain_arrays(torch.stack(self.tokens, 1).cpu().numpy(), torch.stack(self.top2_p, 1).cpu().numpy(),
                            torch.stack(self.top2_i, 1).cpu().numpy(), torch.stack(self.own, 1).cpu().numpy(),
                            probs, self.greedy)


def top_two(logits: torch.Tensor, temps: torch.Tensor | None = None):
    """(the top two probabilities [B, 2] at `temps` (None: 1), their tokens [B, 2]): from
    two max-reductions and a logsumexp of the logits, without the vocabulary-wide softmax
    and sort a greedy chain does not need (a drafter's chain on the device uses this)."""
    x = logits.float() if temps is None else logits.float() / temps
    v1, i1 = x.max(-1, keepdim=True)
    v2, i2 = x.scatter(-1, i1, float("-inf")).max(-1, keepdim=True)
    top_p = (torch.cat([v1, v2], -1) - torch.logsumexp(x, -1, keepdim=True)).exp()
    return top_p, torch.cat([i1, i2], -1)


def chain_arrays(tokens, top_p, top_i, own, probs, greedy: list[bool]):
    """Host arrays of a chain ([B, D] each; top_p, top_i [B, D, 2]; probs [B, D, V] or None)
    -> (tokens, probs, own, alt_tokens, alt_probs) as split() takes them."""
    tokens, top_i = tokens.astype(np.int32), top_i.astype(np.int32)
    first_is_mine = top_i[..., 0] == tokens
    alt_tokens = np.where(first_is_mine, top_i[..., 1], top_i[..., 0]).astype(np.int32)
    alt_probs = np.where(first_is_mine, top_p[..., 1], top_p[..., 0]).astype(np.float32)
    if probs is not None:
        for b, g in enumerate(greedy):
            if g:  # at T = 0 a draft is a point mass: that is what the verifier must use
                probs[b] = 0.0
                probs[b, np.arange(tokens.shape[1]), tokens[b]] = 1.0
    return tokens, probs, own.astype(np.float32), alt_tokens, alt_probs


def split(requests, tokens, probs, own, alt_tokens, alt_probs) -> list[Draft]:
    """Per-request Drafts cut to each request's depth (shared by the batched back ends)."""
    return [Draft(tokens[b, :r.depth], None if probs is None else probs[b, :r.depth],
                  own[b, :r.depth], alt_tokens[b, :r.depth], alt_probs[b, :r.depth])
            for b, r in enumerate(requests)]
