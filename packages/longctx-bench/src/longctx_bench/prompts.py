"""Prompts of an exact token count, as token ids (the completions API takes them, so the
count is exact, not approximate). Body text is synthetic, natural-looking and
deterministic from the seed, or a user's prompt file; a cold prompt starts with a fresh
random salt so no prefix cache can hit; a warm run re-sends the same prompt.
"""

from __future__ import annotations

import hashlib
import random

WORDS = ("the system serves long requests while memory on each node stays scarce and every "
         "table of rows moves over the link as the engine decodes one token after another "
         "with drafts that a small model proposes and the target verifies in a single pass "
         "so the operator measures time to first token step time and throughput under load "
         "across contexts of thirty two thousand one hundred fifty thousand and more tokens "
         "where the cache holds keys and values for every sequence that runs at once").split()


def synthetic_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    sentences, words = [], 0
    while words < n_words:
        k = rng.randint(8, 20)
        s = " ".join(rng.choice(WORDS) for _ in range(k))
        sentences.append(s[0].upper() + s[1:] + ".")
        words += k
    return " ".join(sentences)


SALT_TOKENS = 16  # random tokens first: the first block's hash differs, and hashes chain


class PromptSource:
    """Body token ids long enough for the largest context, tokenized once. A salt is
    SALT_TOKENS ids drawn at random from the body's own ids (always valid tokens)."""

    def __init__(self, body_ids: list[int], seed: int):
        self.body = body_ids
        self.vocab = sorted(set(body_ids))
        self.rng = random.Random(seed)

    def make(self, tokens: int, cold: bool) -> list[int]:
        if tokens > len(self.body):
            raise ValueError(f"the prompt body has {len(self.body)} tokens; {tokens} requested")
        salt = self.rng.choices(self.vocab, k=SALT_TOKENS) if cold else []
        return (salt + self.body)[:tokens]


def digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
