"""Shadow parity: the remote worker and a local copy of the same drafter see the same
rounds; the fraction of identical drafts is what an operator checks before enabling remote
drafting (greedy must be 100%). The remote drafts drive decoding; the local ones are only
compared."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Parity:
    compared: int = 0
    identical: int = 0
    remote_missing: int = 0  # rounds where the remote gave no drafts (failure) but local did
    first_difference: dict = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.identical / self.compared if self.compared else float("nan")


class ShadowClient:
    """Looks like a DrafterClient to the engine; feeds both clients and compares."""

    def __init__(self, remote, local):
        self.remote, self.local, self.parity = remote, local, Parity()

    def add_request(self, *args, **kwargs) -> None:
        self.remote.add_request(*args, **kwargs)
        self.local.add_request(*args, **kwargs)

    def commit(self, *args, **kwargs) -> None:
        self.remote.commit(*args, **kwargs)
        self.local.commit(*args, **kwargs)

    def release(self, rid: int) -> None:
        self.remote.release(rid)
        self.local.release(rid)

    def propose(self, k=None) -> dict:
        remote, local = self.remote.propose(k), self.local.propose(k)
        for rid, mine in local.items():
            theirs = remote.get(rid)
            if theirs is None:
                self.parity.remote_missing += 1
                continue
            self.parity.compared += 1
            if np.array_equal(theirs.tokens, mine.tokens):
                self.parity.identical += 1
            elif not self.parity.first_difference:
                self.parity.first_difference = {"request": rid, "remote": theirs.tokens.tolist(),
                                                "local": mine.tokens.tolist()}
        return remote


def synthetic_prompts(count: int, vocab: int, length: int = 48, seed: int = 0) -> dict:
    """Token prompts with repeated phrases (so prompt lookup has something to find)."""
    rng = np.random.default_rng(seed)
    prompts = {}
    for rid in range(1, count + 1):
        phrase = rng.integers(0, vocab, 8).tolist()
        noise = rng.integers(0, vocab, length).tolist()
        prompts[rid] = (noise[: length // 2] + phrase + noise[length // 2:] + phrase)[:length + 16]
    return prompts
