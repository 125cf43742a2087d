"""How a drafter picks a token from its distribution: the argmax at T = 0, otherwise a
draw seeded by (request seed, absolute position), so the same request drafts the same
tokens on CPU or GPU, fresh or from the speculation cache, local or remote. Torch-free."""

from __future__ import annotations

import numpy as np

GREEDY_BELOW = 1e-5  # ARCHITECTURE.md § DSpark verification: below this temperature both sides are one-hot


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def draw(probs: np.ndarray, seed: int, position: int) -> int:
    """A draw from `probs` with the request's generator at `position`."""
    return inverse_cdf(probs, np.random.default_rng([seed & (2**63 - 1), position]).random())


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The token whose cumulative-probability interval holds u in [0, 1)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(probs) - 1))


def one_hot(tokens: np.ndarray, vocab: int) -> np.ndarray:
    out = np.zeros((len(tokens), vocab), np.float32)
    out[np.arange(len(tokens)), tokens] = 1.0
    return out
