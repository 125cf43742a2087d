"""The DSpark verification rule (ARCHITECTURE.md § DSpark verification) for one chain, on
the host: what the reference loop (decode_loop) applies to a round's drafts and the
target's distributions. Torch-free.

Accept draft i if u < min(1, p_t(x)/max(p_d(x), 1e-8)); at the first rejection draw from
norm(max(p_t - p_d, 0)) (p_t when that mass <= 1e-8); if all are accepted draw a bonus
token from p_t. With p_d one-hot (a proposer that returns tokens only) the output still
follows p_t exactly; at T = 0 everything is one-hot and the output is plain greedy."""

from __future__ import annotations

import numpy as np

from .sampling import inverse_cdf


def verify_chain(drafts: np.ndarray, p_draft: np.ndarray | None, p_target: np.ndarray,
                 rng: np.random.Generator) -> tuple[int, int]:
    """drafts [k], p_draft [k, V] (None: one-hot drafts), p_target [k + 1, V] ->
    (accepted count, the token that follows them)."""
    for i, x in enumerate(int(t) for t in drafts):
        pd = p_draft[i] if p_draft is not None else None
        pd_x = 1.0 if pd is None else float(pd[x])
        if rng.random() < min(1.0, float(p_target[i, x]) / max(pd_x, 1e-8)):
            continue
        if pd is None:
            pd = np.zeros_like(p_target[i])
            pd[x] = 1.0
        residual = np.maximum(p_target[i].astype(np.float64) - pd, 0.0)
        mass = residual.sum()
        return i, sample(residual / mass if mass > 1e-8 else p_target[i], rng)
    return len(drafts), sample(p_target[len(drafts)], rng)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return inverse_cdf(p, rng.random())
