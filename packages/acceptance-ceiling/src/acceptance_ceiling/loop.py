"""A reference speculative loop (DSpark chain verification, ARCHITECTURE.md § DSpark verification) over two
distribution callables: the measurement the predictions are validated against.

Each round: the drafter proposes up to k tokens left to right; draft i is accepted if
u < min(1, p_t(x)/p_d(x)); at the first rejection a token is sampled from
norm(max(p_t - p_d, 0)) (p_t when that mass <= 1e-8); if all are accepted a bonus token
comes from p_t. At T = 0 both are one-hot and the output equals plain greedy decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .chain import Dist


@dataclass
class LoopResult:
    tokens: list = field(default_factory=list)
    accepted: list = field(default_factory=list)  # accepted drafts per round
    round_starts: list = field(default_factory=list)  # the prefix each round started from

    @property
    def mean_accepted_length(self) -> float:
        return 1 + float(np.mean(self.accepted)) if self.accepted else float("nan")


def speculative_generate(target: Dist, drafter: Dist, prompt: Sequence[int], k: int,
                         new_tokens: int, rng: np.random.Generator) -> LoopResult:
    seq, out = list(prompt), LoopResult()
    while len(out.tokens) < new_tokens:
        out.round_starts.append(list(seq))
        drafts, pds = [], []
        for _ in range(k):
            pd = drafter(seq + drafts)
            x = int(rng.choice(len(pd), p=pd))
            drafts.append(x)
            pds.append(pd)
        n, nxt = 0, None
        for i, x in enumerate(drafts):
            pt = target(seq + drafts[:i])
            if rng.random() < min(1.0, pt[x] / max(pds[i][x], 1e-8)):
                n += 1
                continue
            residual = np.maximum(pt - pds[i], 0.0)
            p = residual / residual.sum() if residual.sum() > 1e-8 else pt
            nxt = int(rng.choice(len(p), p=p))
            break
        if nxt is None:
            pt = target(seq + drafts)
            nxt = int(rng.choice(len(pt), p=pt))
        step = drafts[:n] + [nxt]
        seq += step
        out.tokens += step
        out.accepted.append(n)
    out.tokens = out.tokens[:new_tokens]
    return out


def plain_generate(target: Dist, prompt: Sequence[int], new_tokens: int,
                   rng: np.random.Generator) -> list[int]:
    """Target-only decoding (the reference the speculative output must equal at T = 0)."""
    seq = list(prompt)
    for _ in range(new_tokens):
        pt = target(seq)
        seq.append(int(rng.choice(len(pt), p=pt)))
    return seq[len(prompt):]
