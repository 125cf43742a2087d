"""Expected accepted drafts per round for chain depth k.

A draft x_i ~ p_d(. | prefix) is accepted with probability min(1, p_t(x_i)/p_d(x_i)), so
drafting and accepting x has probability min(p_t(x), p_d(x)); the next draft is conditioned
on prefix + x. Hence, exactly,
    E_k(prefix) = sum_x min(p_t(x|prefix), p_d(x|prefix)) * (1 + E_{k-1}(prefix + x)),  E_0 = 0,
and a round yields 1 + E_k tokens (the correction or bonus token always comes).
The recursion visits only tokens with min > 0: at T = 0 that is the one greedy path (k model
calls), for a tiny vocabulary the whole tree; past `max_calls` use the Monte Carlo estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Dist = Callable[[Sequence[int]], np.ndarray]  # prefix -> adjusted next-token distribution


@dataclass(frozen=True)
class Estimate:
    mean: float          # expected accepted drafts per round
    low: float           # 95% interval (equal to mean when exact)
    high: float
    method: str          # "exact", "monte-carlo", "approximation: reference-path product"

    @property
    def accepted_length(self) -> float:
        """Tokens per round: 1 + accepted drafts."""
        return 1 + self.mean


class TooLarge(RuntimeError):
    pass


def exact(target: Dist, drafter: Dist, prefix: Sequence[int], k: int,
          max_calls: int = 100_000) -> Estimate:
    calls = [0]

    def e(pre: tuple, depth: int) -> float:
        if depth == 0:
            return 0.0
        calls[0] += 1
        if calls[0] > max_calls:
            raise TooLarge(f"more than {max_calls} prefixes: use monte_carlo")
        both = np.minimum(target(pre), drafter(pre))
        total = 0.0
        for x in np.flatnonzero(both > 0):
            total += both[x] * (1 + (e(pre + (int(x),), depth - 1) if depth > 1 else 0.0))
        return total

    m = e(tuple(prefix), k)
    return Estimate(m, m, m, "exact")


def monte_carlo(target: Dist, drafter: Dist, prefix: Sequence[int], k: int, samples: int,
                rng: np.random.Generator) -> Estimate:
    """Simulate the acceptance rule; mean with a normal 95% interval."""
    counts = np.empty(samples)
    for s in range(samples):
        pre, n = list(prefix), 0
        for _ in range(k):
            pd, pt = drafter(pre), target(pre)
            x = int(rng.choice(len(pd), p=pd))
            if rng.random() >= min(1.0, pt[x] / pd[x]):
                break
            n += 1
            pre.append(x)
        counts[s] = n
    mean = float(counts.mean())
    half = 1.96 * float(counts.std(ddof=1)) / math.sqrt(samples) if samples > 1 else math.inf
    return Estimate(mean, mean - half, mean + half, "monte-carlo")


def oracle(target: Dist, prefix: Sequence[int], k: int) -> Estimate:
    """The ceiling for a token-only drafter: propose the target's argmax (one-hot draft).
    Accepted with probability p_t(argmax); at T = 0 every draft is accepted (E = k)."""
    pre, keep, total = list(prefix), 1.0, 0.0
    for _ in range(k):
        pt = target(pre)
        x = int(np.argmax(pt))
        keep *= float(pt[x])
        total += keep
        pre.append(x)
    return Estimate(total, total, total, "exact")


def reference_path(alphas: np.ndarray, k: int) -> Estimate:
    """From per-position alphas along a reference text only (logprob files): E_k ~
    sum_j prod_{i<=j} alpha_i. An approximation: it assumes the drafted prefix is the
    reference one."""
    a = np.asarray(alphas, dtype=np.float64)[:k]
    m = float(np.cumprod(a).sum())
    return Estimate(m, m, m, "approximation: reference-path product")
