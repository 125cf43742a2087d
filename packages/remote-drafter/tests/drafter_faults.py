"""A test drafter (loaded as 'drafter_faults:faulty'): n-gram drafts, and faults by the
worker's round count, in cycles of FAULT_CYCLE rounds: the second of a cycle raises (its
entries fail), the third sleeps FAULT_SLOW_S (past the engine's round deadline: it times
out and its reply comes late), the fourth sleeps FAULT_LATE_S (within the deadline: it
arrives after vLLM took the drafts); the rest, the worker's warm-up first, are served at
once."""

import itertools
import os
import time

from remote_drafter.models.registry import load_drafter


def faulty(target, device, **options):
    drafter = load_drafter("ngram", target, device, **options)
    cycle = int(os.environ.get("FAULT_CYCLE", "6"))
    slow, late = float(os.environ["FAULT_SLOW_S"]), float(os.environ["FAULT_LATE_S"])
    rounds, draft, retries = itertools.count(), drafter.draft, [0]

    def with_faults(requests, want_probs):
        # the worker drafts a failed batch's requests again one by one: those fail too
        if retries[0]:
            retries[0] -= 1
            raise RuntimeError("injected drafter fault (retry)")
        phase = next(rounds) % cycle
        if phase == 1:
            retries[0] = len(requests)
            raise RuntimeError("injected drafter fault")
        time.sleep({2: slow, 3: late}.get(phase, 0.0))
        return draft(requests, want_probs)

    drafter.draft = with_faults
    return drafter
