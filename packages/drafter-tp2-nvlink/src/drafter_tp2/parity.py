"""TP2 drafts against the one-card drafter's: the check the tests, the CPU check and the GPU
script all make, written once."""

from __future__ import annotations

import numpy as np

from remote_drafter.models.base import Drafter, DraftRequest


def compare_single_rounds(client, one: Drafter, rounds: int, max_tokens: int, seed: int,
                          temperature: float = 0.0) -> dict:
    """`rounds` single-request rounds (greedy, or drawn at `temperature` with the request's
    own seed), each a random history of 2..max_tokens tokens with random hidden rows, sent
    through `client` (a DrafterClient of the worker under test) and drafted by `one` (the
    one-card drafter) directly. Returns {"rounds", "identical", "difference_top2_gaps"}:
    where they differ, the one-card drafter's top-2 probability gap at the first differing
    draft (correct sharding leaves only near ties)."""
    rng = np.random.default_rng(seed)
    same, gaps = 0, []
    for rid in range(rounds):
        n = int(rng.integers(2, max_tokens))
        tokens = rng.integers(0, one.vocab_size - 1, n).astype(np.int32)
        rows = rng.standard_normal((n - 1, one.feature)).astype(np.float32)
        client.add_request(rid, tokens, rows, temperature, seed=rid)
        theirs = client.propose()[rid].tokens
        client.release(rid)
        history = one.new_history()
        history.reset(tokens, rows[-one.window:])
        mine = one.draft([DraftRequest(history, 5, temperature, rid)], want_probs=True)[0]
        if np.array_equal(theirs, mine.tokens):
            same += 1
        else:
            i = int(np.flatnonzero(theirs != mine.tokens)[0])
            gaps.append(float(mine.own_probs[i] - mine.alt_probs[i]))
    client.propose()  # sends the last release: the worker holds nothing afterwards
    return {"rounds": rounds, "identical": same, "difference_top2_gaps": gaps}
