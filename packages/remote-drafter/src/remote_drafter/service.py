"""The drafter service: per-request state, capacity, validation, batching, the speculation
cache. The worker serves it over ofl; local mode calls it in the engine's own process, so
both run the same code on the same bytes.

One handle() call is one round: every entry is validated before any state changes, the
entries that want drafts are drafted in one batch on the device, and a bad entry gets its
own error status while the others are served.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
import time
from dataclasses import dataclass

import numpy as np

from . import protocol as P
from .drafters import Drafter, DraftRequest
from .history import History
from .metrics import Metrics
from .spec_cache import SpeculationCache

log = logging.getLogger("remote_drafter.service")

COUNTERS = {
    "rounds": "Round messages answered",
    "rounds_refused": "Round messages refused whole (malformed, wrong version or identity)",
    "entries_drafted": "Entries answered with drafts",
    "drafts": "Draft tokens returned",
    "opens": "Requests opened (including re-opens after state loss)",
    "releases": "Requests released by the client",
    "idle_releases": "Requests released after the idle timeout",
    "unknown_requests": "Entries for a request this worker does not hold (client re-opens)",
    "capacity_refusals": "Opens refused because the worker is full",
    "invalid_entries": "Entries refused as invalid (ids, sizes, rows)",
    "draft_errors": "Batches whose drafting raised (their entries got no drafts)",
    "request_bytes": "Request bytes received",
    "committed_tokens": "Committed tokens received",
    "spec_cache_hits": "Entries answered from the speculation cache",
    "spec_cache_misses": "Entries the cache had planned for but missed (drafted fresh)",
    "spec_cache_predrafts": "Outcomes pre-drafted while the target verified",
    "spec_cache_predrafts_skipped": "Pre-draft jobs abandoned because the round arrived first",
    "spec_cache_predraft_errors": "Pre-drafts that raised",
    "spec_cache_jobs_dropped": "Pre-draft jobs dropped because the job queue was full",
    "spec_cache_evictions": "Cache entries evicted by the memory bound",
}
HISTOGRAMS = {
    "draft": "Device time of one drafted batch",
    "entry_hit": "Service time of an entry answered from the cache",
    "entry_fresh": "Service time of an entry drafted fresh",
}


@dataclass
class Session:
    history: History
    temperature: float
    seed: int
    last_used: float


@dataclass
class ServiceConfig:
    max_requests: int = 256
    idle_timeout_s: float = 600.0
    spec_cache: bool = False
    spec_cache_outcomes: int = 3
    spec_cache_bytes: int = 64 << 20
    spec_cache_max_batch: int = 2  # rounds drafting more requests than this skip the cache


class DraftService:
    def __init__(self, drafter: Drafter, config: ServiceConfig | None = None):
        self.drafter, self.config = drafter, config or ServiceConfig()
        self.manifest = drafter.manifest()
        self.fingerprint = self.manifest.fingerprint
        self.sessions: dict[int, Session] = {}
        self.state_lock = threading.Lock()
        self.device_lock = threading.Lock()
        self.fresh_waiting = 0  # rounds drafting now: pre-drafts wait for them
        self.metrics = Metrics("remote_drafter_worker", COUNTERS, HISTOGRAMS)
        self.cache = None
        if self.config.spec_cache:
            if drafter.feature:
                raise ValueError(
                    "the speculation cache needs a drafter whose next round depends on tokens "
                    "alone; this one reads the target's hidden states, which the next "
                    "verification produces (use token-only mode, lm or ngram, or turn the "
                    "cache off)")
            self.cache = SpeculationCache(self, self.config.spec_cache_outcomes,
                                          self.config.spec_cache_bytes)

    # -- what the handshake tells clients --------------------------------------------------
    def describe(self) -> dict:
        per_request = self.drafter.new_history().nbytes_max
        return {"manifest": self.manifest.to_json(), "protocol": P.VERSION,
                "drafter": self.drafter.describe(), "max_requests": self.config.max_requests,
                "bytes_per_request": per_request, "spec_cache": self.cache is not None,
                "round_bytes_per_token": {d: P.round_bytes_per_token(self.drafter.feature, d)
                                          for d in P.ROW_DTYPES}}

    def warm_up(self) -> float:
        """Draft once for a throwaway request (lazy kernel and allocator set-up happen here,
        not in a client's first round); returns the seconds it took."""
        d = self.drafter
        history = d.new_history()
        rows = np.zeros((min(d.window, 7), d.feature), np.float32) if d.feature else None
        history.reset(np.zeros(8, np.int32), rows)
        t0 = time.perf_counter()
        with self.device_lock:
            d.draft([DraftRequest(history, d.max_depth)], want_probs=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

    # -- one round ---------------------------------------------------------------------------
    def handle(self, payload: bytes) -> bytes:
        try:
            kind, entries = P.parse_request(payload, self.fingerprint)
        except P.ProtocolError:
            self.metrics.inc("rounds_refused")
            raise  # the ofl server turns it into an error reply and keeps serving
        self.metrics.inc("request_bytes", len(payload))
        if kind == P.KIND_STATS:
            return P.encode_stats_reply(self.stats())
        self.metrics.inc("rounds")
        started = time.perf_counter()
        replies: dict[int, P.Reply] = {}
        batch: list[tuple[P.Entry, DraftRequest]] = []
        # The cache serves small rounds only: they draft each request alone, which is what
        # makes a hit bit-identical to a fresh round; large rounds draft in one batch.
        drafting = sum(1 for e in entries if e.k and e.op != P.OP_RELEASE)
        cached = self.cache is not None and drafting <= self.config.spec_cache_max_batch
        with self.state_lock:
            self._expire_idle()
            for e in entries:
                reply, request = self._apply(e, cached)
                if reply is not None:
                    replies[e.request_id] = reply
                elif request is not None:
                    batch.append((e, request))
        if batch:
            self._draft(batch, replies, started, cached)
        return P.encode_reply([replies[e.request_id] for e in entries], self.drafter.vocab_size)

    def _apply(self, e: P.Entry, cached: bool) -> tuple[P.Reply | None, DraftRequest | None]:
        """Validate and apply one entry; (reply now, None) or (None, what to draft)."""
        rid, now = e.request_id, time.monotonic()
        if e.op == P.OP_RELEASE:
            self._release(rid)
            self.metrics.inc("releases")
            return P.Reply(rid, P.STATUS_RELEASED), None
        why = self._invalid(e)
        if why:
            self.metrics.inc("invalid_entries")
            return P.Reply(rid, P.STATUS_INVALID, message=why), None
        session = self.sessions.get(rid)
        if e.op == P.OP_OPEN:
            if session is None and len(self.sessions) >= self.config.max_requests:
                self.metrics.inc("capacity_refusals")
                return P.Reply(rid, P.STATUS_CAPACITY, message=(
                    f"worker full: {len(self.sessions)} of {self.config.max_requests} requests "
                    f"open ({self.describe()['bytes_per_request']} bytes each)")), None
            history = self.drafter.new_history()
            why = history.check(e.tokens, e.rows, opening=True)
            if why is None and e.length < len(e.tokens):
                why = f"length {e.length} is shorter than the {len(e.tokens)} tokens sent"
            if why:
                self.metrics.inc("invalid_entries")
                return P.Reply(rid, P.STATUS_INVALID, message=why), None
            history.reset(e.tokens, e.rows, e.length)
            session = self.sessions[rid] = Session(history, e.temperature, e.seed, now)
            if self.cache is not None:
                self.cache.forget(rid)
            self.metrics.inc("opens")
            base_length, new_tokens = None, None
        else:
            if session is None:
                self.metrics.inc("unknown_requests")
                return P.Reply(rid, P.STATUS_UNKNOWN, message="request not open here "
                               "(worker restarted, idle timeout or released): re-open it"), None
            why = session.history.check(e.tokens, e.rows, opening=False)
            if why:
                self.metrics.inc("invalid_entries")
                return P.Reply(rid, P.STATUS_INVALID, message=why), None
            base_length, new_tokens = session.history.length, e.tokens
            session.history.extend(e.tokens, e.rows)
            session.last_used = now
        self.metrics.inc("committed_tokens", len(e.tokens))
        if e.k == 0:
            if self.cache is not None:
                self.cache.forget(rid)
            return P.Reply(rid), None
        depth = min(e.k + 1, self.drafter.max_depth) if cached else e.k
        # A snapshot (History replaces its arrays, never writes into them): the batch drafts
        # outside the state lock.
        request = DraftRequest(copy.copy(session.history), depth, session.temperature, session.seed)
        if not cached and self.cache is not None:
            self.cache.forget(rid)
        if cached and new_tokens is not None:
            t0 = time.perf_counter()
            hit = self.cache.lookup(rid, base_length, new_tokens, request, e.want_probs)
            if hit is not None:
                self.metrics.inc("spec_cache_hits")
                self.cache.plan(rid, session, hit, e.k, request, e.want_probs)
                self._count_drafts(hit.tokens[:e.k])
                self.metrics.observe("entry_hit", time.perf_counter() - t0)
                return self._reply(e, hit, P.CACHE_HIT, t0), None
            self.metrics.inc("spec_cache_misses")
        return None, request

    def _invalid(self, e: P.Entry) -> str | None:
        d = self.drafter
        if e.op not in (P.OP_CONTINUE, P.OP_OPEN):
            return f"unknown op {e.op}"
        if e.k > d.max_depth:
            return f"k = {e.k} exceeds this drafter's depth {d.max_depth}"
        if len(e.tokens) and (e.tokens.min() < 0 or e.tokens.max() >= d.vocab_size):
            return f"token ids outside [0, {d.vocab_size})"
        if not math.isfinite(e.temperature) or e.temperature < 0:
            return f"temperature {e.temperature} is not a finite value >= 0"
        if e.rows is not None and e.feature != d.feature:
            return f"hidden rows of width {e.feature}, this drafter takes {d.feature}"
        if e.op == P.OP_CONTINUE and len(e.tokens) > d.history_tokens:
            return f"{len(e.tokens)} tokens in one round exceed the history bound {d.history_tokens}"
        return None

    def _draft(self, batch, replies: dict, started: float, cached: bool) -> None:
        want_probs = any(e.want_probs for e, _ in batch)
        t0 = time.perf_counter()
        try:
            if not cached:
                with self.device_lock:
                    drafts = self.drafter.draft([r for _, r in batch], want_probs)
            else:
                # Pre-drafts run one request at a time, and a matmul's bits depend on how
                # many rows it multiplies (CPU and GPU BLAS alike): drafting alone here too
                # is what makes a hit bit-identical to a fresh round.
                drafts = []
                with self.fresh_round():
                    for _, r in batch:
                        with self.device_lock:
                            drafts += self.drafter.draft([r], want_probs)
        except Exception as exc:  # noqa: BLE001 - fail these entries closed, keep serving
            log.exception("drafting a batch of %d failed", len(batch))
            self.metrics.inc("draft_errors")
            for e, _ in batch:
                replies[e.request_id] = P.Reply(e.request_id, P.STATUS_INVALID,
                                                message=f"drafting failed: {type(exc).__name__}: {exc}")
            return
        self.metrics.observe("draft", time.perf_counter() - t0)
        with self.state_lock:
            for (e, request), draft in zip(batch, drafts):
                replies[e.request_id] = self._reply(e, draft, P.CACHE_MISS if cached else
                                                    P.CACHE_NONE, started)
                self._count_drafts(draft.tokens[:e.k])
                self.metrics.observe("entry_fresh", time.perf_counter() - started)
                session = self.sessions.get(e.request_id)
                if cached and session is not None \
                        and session.history.length == request.history.length:
                    self.cache.plan(e.request_id, session, draft, e.k, request, e.want_probs)

    @contextlib.contextmanager
    def fresh_round(self):
        with self.state_lock:
            self.fresh_waiting += 1
        try:
            yield
        finally:
            with self.state_lock:
                self.fresh_waiting -= 1

    def _reply(self, e: P.Entry, draft, cache: int, started: float) -> P.Reply:
        probs = draft.probs[:e.k] if e.want_probs and draft.probs is not None else None
        return P.Reply(e.request_id, P.STATUS_OK, draft.tokens[:e.k], probs, cache,
                       int(1e6 * (time.perf_counter() - started)))

    def _count_drafts(self, tokens: np.ndarray) -> None:
        self.metrics.inc("entries_drafted")
        self.metrics.inc("drafts", len(tokens))

    # -- lifetime of requests --------------------------------------------------------------
    def _release(self, rid: int) -> None:
        self.sessions.pop(rid, None)
        if self.cache is not None:
            self.cache.forget(rid)

    def _expire_idle(self) -> None:
        cutoff = time.monotonic() - self.config.idle_timeout_s
        for rid in [r for r, s in self.sessions.items() if s.last_used < cutoff]:
            self._release(rid)
            self.metrics.inc("idle_releases")

    def expire_idle(self) -> None:
        with self.state_lock:
            self._expire_idle()

    def stats(self) -> dict:
        with self.state_lock:
            open_requests = len(self.sessions)
        out = {"open_requests": open_requests, **self.metrics.snapshot(), **self.describe()}
        if self.cache is not None:
            out["spec_cache_bytes"] = self.cache.nbytes
        return out
