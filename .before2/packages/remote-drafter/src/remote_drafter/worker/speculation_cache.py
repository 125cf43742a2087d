"""The speculation cache: drafting while the target verifies.

After answering a round the worker knows its drafts d_1..d_k and, from its own
probabilities, which verification outcomes are likely: all k accepted plus its own next
token as the bonus, then (a accepted, correction c) pairs ranked by
P = prod_{i<=a} q(d_i) * q_{a+1}(c), with c the likeliest token other than d_{a+1}. While
the engine verifies, a background thread drafts the next round for the top outcomes; before
each outcome it waits while a fresh round is drafting. When
the round arrives, its committed tokens say which outcome happened: a hit is answered at
once, a miss is drafted fresh. A hit's drafts are the ones a fresh round would compute
(same history, same seeded draws): the cache changes when drafts are ready, never which.

Exact only for drafters whose next round depends on tokens alone (token-only DSpark, lm,
ngram): a hidden-state drafter's next context is the target's verification output, which
no one knows in advance, so the worker refuses the cache for it.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from remote_drafter.models.base import Draft, DraftRequest

log = logging.getLogger("remote_drafter.worker.speculation_cache")


@dataclass
class Outcome:
    tokens: tuple            # the tokens the round would commit
    probability: float


@dataclass
class CacheEntry:
    base_length: int         # committed tokens when the outcomes were planned
    temperature: float
    seed: int
    want_probs: bool
    depth: int
    results: dict = field(default_factory=dict)  # outcome tokens -> Draft

    @property
    def nbytes(self) -> int:
        return sum(4 * d.tokens.nbytes + (0 if d.probs is None else d.probs.nbytes)
                   for d in self.results.values())  # tokens, own, alt tokens, alt probs


def outcomes(draft: Draft, k: int, budget: int) -> list[Outcome]:
    """The likeliest verification outcomes of a round that returned draft.tokens[:k]."""
    d, found = draft.tokens, []
    prefix = np.concatenate([[1.0], np.cumprod(draft.own_probs[:k], dtype=np.float64)])
    if len(d) > k:  # all accepted, bonus = the drafter's own next token
        found.append(Outcome(tuple(int(t) for t in d[:k + 1]), float(prefix[k] * draft.own_probs[k])))
    ranked = []
    for a in range(min(k, len(d))):
        if draft.alt_probs[a] > 0:
            ranked.append(Outcome(tuple(int(t) for t in d[:a]) + (int(draft.alt_tokens[a]),),
                                  float(prefix[a] * draft.alt_probs[a])))
    ranked.sort(key=lambda o: -o.probability)
    return (found + ranked)[:budget]


class SpeculationCache:
    def __init__(self, service, outcomes_per_round: int = 3, max_bytes: int = 64 << 20,
                 max_jobs: int = 256):
        self.service, self.budget, self.max_bytes = service, outcomes_per_round, max_bytes
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self.jobs: queue.Queue = queue.Queue(max_jobs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spec-cache", daemon=True)
        self._thread.start()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued pre-draft ran (tests and benchmarks that model a
        verification long enough for the whole budget). False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.jobs.unfinished_tasks == 0:
                return True
            time.sleep(0.0005)
        return False

    def close(self) -> None:
        self._stop.set()
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=5)

    # -- called by the service under its state lock ------------------------------------------
    def lookup(self, rid: int, base_length: int, new_tokens, request: DraftRequest,
               want_probs: bool) -> Draft | None:
        entry = self.entries.pop(rid, None)  # whatever happens, the old plan is spent
        if entry is None or entry.base_length != base_length or entry.depth < request.depth \
                or entry.temperature != request.temperature or entry.seed != request.seed \
                or (want_probs and not entry.want_probs):
            return None
        found = entry.results.get(tuple(int(t) for t in new_tokens))
        if found is None:
            return None
        n = request.depth
        return Draft(found.tokens[:n], None if found.probs is None else found.probs[:n],
                     found.own_probs[:n], found.alt_tokens[:n], found.alt_probs[:n])

    def plan(self, rid: int, session, draft: Draft, k: int, request: DraftRequest,
             want_probs: bool) -> None:
        """Queue pre-drafts for the likeliest outcomes of the round just answered."""
        found = outcomes(draft, k, self.budget)
        if not found:
            return
        entry = CacheEntry(session.history.length, request.temperature, request.seed,
                           want_probs, request.depth)
        self.entries[rid] = entry
        try:
            self.jobs.put_nowait((rid, entry, copy.deepcopy(session.history), found))
        except queue.Full:
            self.service.metrics.inc("spec_cache_jobs_dropped")
            self.entries.pop(rid, None)

    def forget(self, rid: int) -> None:
        self.entries.pop(rid, None)

    # -- the background thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            job = self.jobs.get()
            if job is None:
                return
            try:
                self._predraft(*job)
            finally:
                self.jobs.task_done()

    def _predraft(self, rid: int, entry: CacheEntry, history, found: list[Outcome]) -> None:
        for outcome in found:
            while self.service.fresh_waiting and not self._stop.is_set():
                time.sleep(0.0002)  # a round is drafting: it goes first
            with self.service.state_lock:
                if self.entries.get(rid) is not entry:  # the round came, or was released
                    self.service.metrics.inc("spec_cache_predrafts_skipped")
                    break
            h = copy.deepcopy(history)
            h.extend(np.array(outcome.tokens, np.int32), None)
            request = DraftRequest(h, entry.depth, entry.temperature, entry.seed)
            try:
                with self.service.device_lock:
                    result = self.service.drafter.draft([request], entry.want_probs)[0]
            except Exception:  # noqa: BLE001 - a failed pre-draft is only a future miss
                log.exception("pre-draft failed")
                self.service.metrics.inc("spec_cache_predraft_errors")
                break
            with self.service.state_lock:
                if self.entries.get(rid) is not entry:
                    break
                entry.results[outcome.tokens] = result
                self.entries.move_to_end(rid)
                self._evict()
            self.service.metrics.inc("spec_cache_predrafts")

    def _evict(self) -> None:
        total = sum(e.nbytes for e in self.entries.values())
        while total > self.max_bytes and self.entries:
            _, old = self.entries.popitem(last=False)
            total -= old.nbytes
            self.service.metrics.inc("spec_cache_evictions")

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
