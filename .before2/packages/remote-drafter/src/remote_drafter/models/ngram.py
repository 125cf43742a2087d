"""Prompt lookup (n-gram) drafting: find the newest earlier occurrence of the longest
suffix of the committed tokens and propose what followed it. No weights, no device,
token-only; the baseline every neural drafter must beat."""

from __future__ import annotations

import hashlib

import numpy as np

from remote_drafter.engine.identity import Manifest

from .base import Draft, Drafter, DraftRequest


class NgramDrafter(Drafter):
    kind = "ngram"

    def __init__(self, vocab_size: int = 1 << 20, min_n: int = 2, max_n: int = 4,
                 max_depth: int = 8, history_tokens: int = 4096, target: Manifest | None = None):
        self.vocab_size, self.min_n, self.max_n = vocab_size, min_n, max_n
        self.max_depth, self.history_tokens, self.window = max_depth, history_tokens, 0
        self.target = target or Manifest()  # the target and tokenizer it serves, when known

    def manifest(self) -> Manifest:
        params = f"ngram:{self.min_n}:{self.max_n}:{self.max_depth}".encode()
        return Manifest(self.target.target, self.target.tokenizer,
                        drafter=hashlib.sha256(params).hexdigest(), kind=self.kind)

    def lookup(self, tokens: np.ndarray, depth: int) -> np.ndarray:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = hits[-1] + n
                return tokens[start:start + depth].astype(np.int32)
        return np.zeros(0, np.int32)

    def draft(self, requests: list[DraftRequest], want_probs: bool) -> list[Draft]:
        out = []
        for r in requests:
            tokens = self.lookup(r.history.tokens, r.depth)
            probs = None
            if want_probs:
                probs = np.zeros((len(tokens), self.vocab_size), np.float32)
                probs[np.arange(len(tokens)), tokens] = 1.0
            ones = np.ones(len(tokens), np.float32)
            out.append(Draft(tokens, probs, ones, tokens.copy(), 0 * ones))
        return out
