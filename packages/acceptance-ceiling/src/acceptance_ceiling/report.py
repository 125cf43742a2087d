"""Per prompt and depth: expected accepted drafts (exact or Monte Carlo), the oracle
ceiling; aggregated per workload class with 95% intervals over prompts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .chain import Estimate, TooLarge, exact, monte_carlo, oracle, reference_path
from .pairs import alphas_from_topk


def estimate(target, drafter, prefix: Sequence[int], k: int, samples: int,
             rng: np.random.Generator, max_calls: int) -> Estimate:
    try:
        return exact(target, drafter, prefix, k, max_calls=max_calls)
    except TooLarge:
        return monte_carlo(target, drafter, prefix, k, samples, rng)


def interval(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    half = 1.96 * a.std(ddof=1) / math.sqrt(len(a)) if len(a) > 1 else 0.0
    return {"mean": float(a.mean()), "low": float(a.mean() - half),
            "high": float(a.mean() + half), "n": len(a)}


def model_report(target, drafter, prompts: dict[str, list[list[int]]], k_max: int,
                 samples: int = 2000, seed: int = 0, max_calls: int = 20_000) -> dict:
    rng = np.random.default_rng(seed)
    classes = {}
    for name, prefixes in prompts.items():
        per_k, methods = {}, set()
        for k in range(1, k_max + 1):
            drafted, ceiling = [], []
            for prefix in prefixes:
                e = estimate(target, drafter, prefix, k, samples, rng, max_calls)
                methods.add(e.method)
                drafted.append(e.accepted_length)
                ceiling.append(oracle(target, prefix, k).accepted_length)
            per_k[str(k)] = {"accepted_length": interval(drafted),
                             "oracle_accepted_length": interval(ceiling)}
        classes[name] = {"prompts": len(prefixes), "method": sorted(methods), "k": per_k}
    return {"source": "models", "classes": classes}


def logprob_report(prompts: list[dict], k_max: int) -> dict:
    classes: dict[str, list] = {}
    for p in prompts:
        classes.setdefault(p.get("class", "all"), []).append(alphas_from_topk(p["positions"]))
    out = {}
    for name, series in classes.items():
        per_k = {}
        for k in range(1, k_max + 1):
            vals = [reference_path(a[i:], k).accepted_length
                    for a in series for i in range(0, max(len(a) - k, 0) + 1)]
            per_k[str(k)] = {"accepted_length": interval(vals)}
        out[name] = {"prompts": len(series), "k": per_k, "method": [
            "approximation: reference-path product of top-k alphas (a lower bound per position)"]}
    return {"source": "logprobs", "classes": out}
