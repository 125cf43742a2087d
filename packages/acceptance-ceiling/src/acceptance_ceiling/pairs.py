"""Target/drafter pairs as distribution callables: a tiny Markov demo pair (numpy), torch
causal LMs, and per-position logprob files."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from .dists import adjust


class MarkovPair:
    """A tiny target (order-2 Markov model with random logits) and a drafter that sees the
    same logits plus noise: `noise` sets how far the drafter is from the target."""

    def __init__(self, vocab: int = 12, noise: float = 0.7, seed: int = 0,
                 temperature: float = 1.0, top_p: float = 1.0):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.logits_t = rng.normal(0, 2.0, (vocab, vocab, vocab))
        self.logits_d = self.logits_t + rng.normal(0, noise, self.logits_t.shape)
        self.temperature, self.top_p = temperature, top_p

    def _dist(self, table, prefix: Sequence[int]) -> np.ndarray:
        a = prefix[-2] if len(prefix) >= 2 else 0
        b = prefix[-1] if prefix else 0
        return adjust(table[a, b], self.temperature, self.top_p)

    def target(self, prefix: Sequence[int]) -> np.ndarray:
        return self._dist(self.logits_t, prefix)

    def drafter(self, prefix: Sequence[int]) -> np.ndarray:
        return self._dist(self.logits_d, prefix)


def torch_dist(model, temperature: float, top_p: float = 1.0):
    """prefix -> adjusted distribution from a causal LM returning logits [1, T, V]
    (a module called on input ids, or a function)."""
    import torch

    @torch.no_grad()
    def dist(prefix: Sequence[int]) -> np.ndarray:
        ids = torch.tensor([list(prefix)], dtype=torch.long)
        out = model(ids)
        logits = getattr(out, "logits", out)[0, -1].double().cpu().numpy()
        return adjust(logits, temperature, top_p)

    return dist


def load_logprobs(path: str) -> list[dict]:
    """A JSON list of prompts: {"class": str, "positions": [{"target": {token: logprob},
    "draft": {token: logprob}}, ...]} (top-k each, as servers report them)."""
    with open(path) as f:
        prompts = json.load(f)
    if not isinstance(prompts, list):
        raise ValueError(f"{path}: expected a JSON list of prompts")
    return prompts


def alphas_from_topk(positions: list[dict]) -> np.ndarray:
    """Per-position alpha from top-k logprobs: the shared top-k mass counts; what lies in
    the tails is unknown, so this is a lower bound (stated in the report)."""
    out = []
    for pos in positions:
        t = {k: np.exp(v) for k, v in pos["target"].items()}
        d = {k: np.exp(v) for k, v in pos["draft"].items()}
        out.append(sum(min(t[x], d[x]) for x in t.keys() & d.keys()))
    return np.array(out)
