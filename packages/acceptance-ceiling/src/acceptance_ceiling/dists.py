"""Next-token distributions as the verifier sees them: temperature and top-p applied on
both sides; T = 0 is the one-hot argmax (ARCHITECTURE.md § DSpark verification: below
1e-5 both are one-hot)."""

from __future__ import annotations

import numpy as np

GREEDY_BELOW = 1e-5


def adjust(logits: np.ndarray, temperature: float, top_p: float = 1.0) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    if temperature < GREEDY_BELOW:
        out = np.zeros_like(logits)
        out[..., :] = 0
        idx = np.argmax(logits, axis=-1)
        np.put_along_axis(out, np.expand_dims(idx, -1), 1.0, axis=-1)
        return out
    z = logits / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < top_p  # the nucleus
        keep = np.zeros_like(p, dtype=bool)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def alpha(p_target: np.ndarray, p_draft: np.ndarray) -> np.ndarray:
    """Probability that one draft is accepted: sum over x of min(p_t(x), p_d(x))."""
    return np.minimum(p_target, p_draft).sum(axis=-1)
