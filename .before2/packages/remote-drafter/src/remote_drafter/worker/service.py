"""The drafter service: per-request state, capacity, validation, batching, the speculation
cache. The worker serves it over ofl; local mode calls it in the engine's own process, so
both run the same code on the same bytes.

One handle() call is one round: each entry is validated before it changes any state, the
entries that want drafts are drafted in one batch on the device, and a bad entry gets its
own error status while the others are served. Requests are named (peer, client id, request
id): the peer is the address the ofl server saw at accept, so no peer can name another's
requests, whatever client id it writes.

Against a greedy or hostile peer: the quota is charged per peer address, across all its
connections and client ids (which it chooses freely, so they cannot be what is charged): a
peer holds at most its quota of requests (the worker's CLI sets half the slots by default),
so one peer cannot take the slots another needs; and each entry's reply is sized before
anything is drafted, so a small request cannot make the worker build a reply larger than
the link carries.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

from ofl.testing import link_delay
from remote_drafter.engine import protocol as P
from remote_drafter.engine.history import History
from remote_drafter.engine.metrics import Metrics
from remote_drafter.engine.rows import all_finite
from remote_drafter.models.base import Drafter, DraftRequest

from .speculation_cache import SpeculationCache

log = logging.getLogger("remote_drafter.worker.service")

COUNTERS = {
    "rounds": "Round messages answered",
    "rounds_refused": "Round messages refused whole (malformed, wrong version or identity)",
    "entries_drafted": "Entries answered with drafts",
    "drafts": "Draft tokens returned",
    "opens": "Requests opened (including re-opens after state loss)",
    "releases": "Requests released by the client",
    "idle_releases": "Requests released after the idle timeout",
    "unknown_requests": "Entries for a request this worker does not hold (client re-opens)",
    "out_of_step": "Continues whose committed count disagreed with the worker's (client re-opens)",
    "capacity_refusals": "Opens refused because the worker is full",
    "quota_refusals": "Opens refused because their peer holds its quota (per peer: status)",
    "reply_size_refusals": "Entries refused before drafting: their reply would not fit the link's",
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
    "round": "Worker time of one round, its message parsed to its reply encoded: what the engine "
             "waits for besides the link (status: round_p50_ms / round_p99_ms)",
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
class PeerUsage:
    requests: int = 0
    quota_refusals: int = 0


Key = tuple[str, int, int]  # a request's name: (peer address, client id, request id)
LOCAL_PEER = "local"  # in-process (local mode): the engine's own process is the only peer


@dataclass
class ServiceConfig:
    max_requests: int = 256
    # Per peer address, all its connections and client ids (None: no bound of its own).
    # Each request is charged bytes_per_request (what its history can grow to) at its open,
    # so a continue is never refused.
    max_requests_per_client: int | None = None
    max_history_bytes_per_client: int | None = None
    idle_timeout_s: float = 600.0
    spec_cache: bool = False
    spec_cache_outcomes: int = 3
    spec_cache_bytes: int = 64 << 20
    spec_cache_max_batch: int = 2  # rounds drafting more requests than this skip the cache
    inject_delay_s: float = 0.0    # testing: added to every round (a slow link on one machine)
    # Gate rounds recorded from the requests served (round_recorder.RoundRecorder): the file, how many,
    # drafts per round (None: the drafter's max depth).
    record_gate_rounds: str | None = None
    gate_rounds: int = 64
    gate_depth: int | None = None
    gate_spacing: int = 256        # positions between two rounds of one request

    @property
    def expiry_interval_s(self) -> float:
        """How often the worker's sweeper looks for idle requests, for a worker no round
        reaches (rounds look when the oldest request's timeout has passed)."""
        return max(min(self.idle_timeout_s / 4, 30.0), 0.05)


class DraftService:
    def __init__(self, drafter: Drafter, config: ServiceConfig | None = None):
        self.drafter, self.config = drafter, config or ServiceConfig()
        self.manifest = drafter.manifest()
        self.fingerprint = self.manifest.fingerprint
        self.sessions: dict[Key, Session] = {}
        self.bytes_per_request = drafter.new_history().nbytes_max
        self.quota = self._peer_quota()
        self.peers: dict[str, PeerUsage] = {}  # only peers holding requests: bounded
        # Any admitted peer may ask for status: it names peers by keyed digests, not addresses.
        self._label_key = secrets.token_bytes(16)
        self.max_reply_bytes = 1 << 62  # local mode has no link; a Worker sets its server's limit
        self.admission: dict | None = None  # who the Worker's server admits; local mode: none
        self.state_lock = threading.Lock()
        self.device_lock = threading.Lock()
        self.fresh_waiting = 0  # rounds drafting now: pre-drafts wait for them
        self._expiry_due = 0.0  # when the least recently used request times out (time.monotonic)
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
        self.recorder = None
        if self.config.record_gate_rounds:
            from .round_recorder import RoundRecorder
            self.recorder = RoundRecorder(self.config.record_gate_rounds, self.config.gate_rounds,
                                          self.config.gate_depth or drafter.max_depth,
                                          self.manifest.target or None, self.config.gate_spacing,
                                          drafter.hidden_layers)

    def _peer_quota(self) -> int:
        """Requests one peer may hold: the tighter of its two quotas."""
        c, per_request = self.config, self.bytes_per_request
        if c.max_requests < 1:
            raise ValueError(f"max_requests {c.max_requests}: a worker holds at least 1 request")
        requests = c.max_requests if c.max_requests_per_client is None else c.max_requests_per_client
        if not 1 <= requests <= c.max_requests:
            raise ValueError(f"max_requests_per_client {requests} is not between 1 and "
                             f"max_requests {c.max_requests}")
        if c.max_history_bytes_per_client is None:
            return requests
        if c.max_history_bytes_per_client < per_request:
            raise ValueError(f"max_history_bytes_per_client {c.max_history_bytes_per_client} is "
                             f"below one request's {per_request} bytes: no request could open")
        return min(requests, c.max_history_bytes_per_client // per_request)

    # -- what the handshake tells clients --------------------------------------------------
    def describe(self) -> dict:
        per_request = self.bytes_per_request
        return {"manifest": self.manifest.to_json(), "protocol": P.VERSION,
                "drafter": self.drafter.describe(), "max_requests": self.config.max_requests,
                "max_requests_per_client": self.quota,
                "max_history_bytes_per_client": self.quota * per_request,
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
        if self.recorder is not None:
            self.recorder.close()  # what it has, if it is not full yet

    # -- one round ---------------------------------------------------------------------------
    def handle(self, payload: bytes, peer: str = LOCAL_PEER) -> bytes:
        """Answer one message from `peer`, the address the ofl server saw (never one the
        message states); its requests and its quota are its own."""
        try:
            request = P.parse_request(payload, self.fingerprint)
        except P.ProtocolError:
            self.metrics.inc("rounds_refused")
            raise  # the ofl server turns it into an error reply and keeps serving
        if request.kind == P.KIND_STATS:
            self.metrics.inc("request_bytes", len(payload))
            return P.encode_stats_reply(self.stats())
        self.metrics.add({"request_bytes": len(payload), "rounds": 1})
        started = time.perf_counter()
        reply = self._round(request, peer, started)
        self.metrics.observe("round", time.perf_counter() - started)
        return reply

    def _round(self, request: P.Request, peer: str, started: float) -> bytes:
        client, entries = request.client_id, request.entries
        if self.config.inject_delay_s:
            link_delay(self.config.inject_delay_s)
        replies: dict[int, P.Reply] = {}
        batch: list[tuple[P.Entry, DraftRequest]] = []
        # The cache serves small rounds only: they draft each request alone, which is what
        # makes a hit bit-identical to a fresh round; large rounds draft in one batch.
        drafting = [e for e in entries if e.k and e.op != P.OP_RELEASE]
        cached = self.cache is not None and len(drafting) <= self.config.spec_cache_max_batch
        # The drafter builds probabilities for the whole batch when any entry wants them, so
        # then every drafting entry is charged for its own, asked for or not.
        vocab = self.drafter.vocab_size if any(e.want_probs for e in drafting) else 0
        # Every entry's ids and rows checked in one pass each; only when one is bad does
        # each entry check its own (and the bad ones are refused).
        screened = P.ids_in_vocab(request.tokens, self.drafter.vocab_size) and \
            (request.rows is None or all_finite(request.rows))
        with self.state_lock:
            # the look passes over every request held: only once one may have timed out
            if time.monotonic() >= self._expiry_due:
                self._expire_idle()
            room, committed = self.max_reply_bytes - P.REPLY_HEADER.itemsize, 0
            try:
                for e in entries:
                    size = P.reply_entry_bytes(e.k if e.op != P.OP_RELEASE else 0, vocab)
                    fits = size <= room
                    reply, draft_request = self._apply((peer, client, e.request_id), e, cached, fits, screened)
                    room -= size if fits else P.reply_entry_bytes(0)  # refused: status only (as the client counts)
                    if reply is not None:
                        replies[e.request_id] = reply
                    elif draft_request is not None:
                        batch.append((e, draft_request))
                    if draft_request is not None or reply.ok:  # its tokens are in its history now
                        committed += len(e.tokens)
            finally:
                self.metrics.add({"committed_tokens": committed})  # once a round, not per entry
        if batch:
            self._draft(peer, client, batch, replies, started, cached)
        return P.encode_reply([replies[e.request_id] for e in entries], self.drafter.vocab_size)

    def _apply(self, key: Key, e: P.Entry, cached: bool, fits: bool,
               screened: bool) -> tuple[P.Reply | None, DraftRequest | None]:
        """Validate and apply one entry; (reply now, None) or (None, what to draft). `fits`:
        its reply fits in what is left of the link's; `screened`: the round's ids are all in
        the vocabulary and its rows all finite."""
        if e.op == P.OP_RELEASE:
            self._release(key)
            self.metrics.inc("releases")
            return P.Reply(e.request_id, P.STATUS_RELEASED), None
        if (refused := self._refusal(e, fits, screened)) is not None:
            return refused, None
        session = self._open(key, e, screened) if e.op == P.OP_OPEN else self._continue(key, e, screened)
        if isinstance(session, P.Reply):
            return session, None
        if self.recorder is not None:
            self.recorder.seen(key, session.history, session.temperature)
        if e.k == 0:
            if self.cache is not None:
                self.cache.forget(key)
            return P.Reply(e.request_id), None
        return self._draft_request(key, session, e, cached)

    def _refusal(self, e: P.Entry, fits: bool, screened: bool) -> P.Reply | None:
        """The reply refusing `e` before it changes any state; None when it may go on."""
        if why := self._invalid(e, screened):
            return self._refuse(e, "invalid_entries", P.STATUS_INVALID, why)
        if e.k and not fits:
            probs = f" with probabilities over {self.drafter.vocab_size} tokens" if e.want_probs else ""
            return self._refuse(e, "reply_size_refusals", P.STATUS_INVALID, (
                f"reply too large: {e.k} drafts{probs} do not fit in what this round leaves of "
                f"the {self.max_reply_bytes}-byte reply the link carries: ask for fewer"))
        return None

    def _refuse(self, e: P.Entry, counter: str, status: int, message: str) -> P.Reply:
        self.metrics.inc(counter)
        return P.Reply(e.request_id, status, message=message)

    def _open(self, key: Key, e: P.Entry, screened: bool) -> Session | P.Reply:
        """(Re-)open e's request from the history it carries; its session, or the refusal."""
        history = self.drafter.new_history()
        why = history.check(e.tokens, e.rows, opening=True, finite=screened)
        if why is None and not len(e.tokens) <= e.length <= P.MAX_LENGTH:
            why = f"length {e.length} is not between the {len(e.tokens)} tokens sent and {P.MAX_LENGTH}"
        if why:
            return self._refuse(e, "invalid_entries", P.STATUS_INVALID, why)
        if key not in self.sessions and (refused := self._admit(key[0], e)) is not None:
            return refused  # a re-open keeps the slot it holds
        if (reopened := self.sessions.get(key)) is not None:
            reopened.history.release()  # its blocks can take the new rows
        history.reset(e.tokens, e.rows, e.length)
        session = self.sessions[key] = Session(history, e.temperature, e.seed, time.monotonic())
        if self.recorder is not None:
            self.recorder.forget(key)  # a re-open starts the request's recording afresh
        if self.cache is not None:
            self.cache.forget(key)
        self.metrics.inc("opens")
        return session

    def _admit(self, peer: str, e: P.Entry) -> P.Reply | None:
        """A new request takes a slot and one of its peer's quota; or the refusal."""
        if len(self.sessions) >= self.config.max_requests:
            return self._refuse(e, "capacity_refusals", P.STATUS_CAPACITY, (
                f"worker full: {len(self.sessions)} of {self.config.max_requests} requests "
                f"open ({self.bytes_per_request} bytes each)"))
        usage = self.peers.get(peer)
        if usage is not None and usage.requests >= self.quota:
            usage.quota_refusals += 1
            return self._refuse(e, "quota_refusals", P.STATUS_QUOTA, (
                f"quota: this client's address holds {usage.requests} requests "
                f"({usage.requests * self.bytes_per_request} bytes of history) across all its "
                "connections and client ids, the most one address may hold here "
                "(--max-requests-per-client, --max-history-bytes-per-client): release some first"))
        self.peers.setdefault(peer, PeerUsage()).requests += 1
        return None

    def _continue(self, key: Key, e: P.Entry, screened: bool) -> Session | P.Reply:
        """Append e's tokens and rows to its request's history; its session, or the refusal
        (a request the worker does not hold, or holds at another length, is re-opened)."""
        session = self.sessions.get(key)
        if session is None:
            return self._refuse(e, "unknown_requests", P.STATUS_UNKNOWN, (
                "request not open here (worker restarted, idle timeout or released): re-open it"))
        if e.length != session.history.length + len(e.tokens):
            self._release(key)
            return self._refuse(e, "out_of_step", P.STATUS_UNKNOWN, (
                f"out of step: the worker holds {session.history.length} tokens, the client "
                f"{e.length - len(e.tokens)}: re-open it"))
        if why := session.history.check(e.tokens, e.rows, opening=False, finite=screened):
            return self._refuse(e, "invalid_entries", P.STATUS_INVALID, why)
        session.history.extend(e.tokens, e.rows)
        session.last_used = time.monotonic()
        return session

    def _draft_request(self, key: Key, session: Session, e: P.Entry,
                       cached: bool) -> tuple[P.Reply | None, DraftRequest | None]:
        """What to draft for `e`; or, on a speculation cache hit, its reply now."""
        depth = min(e.k + 1, self.drafter.max_depth) if cached else e.k
        # A snapshot (History never rewrites rows it has handed out: appends go past them):
        # the batch drafts outside the state lock.
        request = DraftRequest(copy.copy(session.history), depth, session.temperature, session.seed)
        if not cached:
            if self.cache is not None:
                self.cache.forget(key)
            return None, request
        if e.op == P.OP_CONTINUE:  # an open has no earlier round whose outcomes were pre-drafted
            t0 = time.perf_counter()
            before = e.length - len(e.tokens)  # the worker's count before this round
            hit = self.cache.lookup(key, before, e.tokens, request, e.want_probs)
            if hit is not None:
                self.metrics.inc("spec_cache_hits")
                self.cache.plan(key, session, hit, e.k, request, e.want_probs)
                self._count_drafts(hit.tokens[:e.k])
                self.metrics.observe("entry_hit", time.perf_counter() - t0)
                return self._reply(e, hit, P.CACHE_HIT, t0), None
            self.metrics.inc("spec_cache_misses")
        return None, request

    def _invalid(self, e: P.Entry, screened: bool) -> str | None:
        d = self.drafter
        if e.op not in (P.OP_CONTINUE, P.OP_OPEN):
            return f"unknown op {e.op}"
        if e.k > d.max_depth:
            return f"k = {e.k} exceeds this drafter's depth {d.max_depth}"
        if not screened and not P.ids_in_vocab(e.tokens, d.vocab_size):
            return f"token ids outside [0, {d.vocab_size})"
        if not math.isfinite(e.temperature) or e.temperature < 0:
            return f"temperature {e.temperature} is not a finite value >= 0"
        if e.rows is not None and e.feature != d.feature:
            return f"hidden rows of width {e.feature}, this drafter takes {d.feature}"
        if e.op == P.OP_CONTINUE and len(e.tokens) > d.history_tokens:
            return f"{len(e.tokens)} tokens in one round exceed the history bound {d.history_tokens}"
        return None

    def _draft(self, peer: str, client: int, batch, replies: dict, started: float,
               cached: bool) -> None:
        want_probs = any(e.want_probs for e, _ in batch)
        t0 = time.perf_counter()
        with self.fresh_round():
            if cached:
                # Pre-drafts run one request at a time, and a matmul's bits depend on how
                # many rows it multiplies (CPU and GPU BLAS alike): drafting alone here too
                # is what makes a hit bit-identical to a fresh round.
                drafts = [self._draft_alone(r, want_probs) for _, r in batch]
            else:
                try:
                    with self.device_lock:
                        drafts = self.drafter.draft([r for _, r in batch], want_probs)
                except Exception:  # noqa: BLE001 - find the entry that breaks it, serve the rest
                    log.exception("drafting a batch of %d failed; drafting each alone", len(batch))
                    self.metrics.inc("draft_errors")
                    drafts = [self._draft_alone(r, want_probs) for _, r in batch]
        self.metrics.observe("draft", time.perf_counter() - t0)
        served, waits = [], []  # counted once for the round: a lock per entry costs
        with self.state_lock:
            for (e, request), draft in zip(batch, drafts):
                if isinstance(draft, Exception):
                    replies[e.request_id] = P.Reply(e.request_id, P.STATUS_INVALID, message=(
                        f"drafting failed: {type(draft).__name__}: {draft}"))
                    continue
                replies[e.request_id] = self._reply(e, draft, P.CACHE_MISS if cached else
                                                    P.CACHE_NONE, started)
                served.append(len(draft.tokens[:e.k]))
                waits.append(time.perf_counter() - started)
                if cached:
                    key = (peer, client, e.request_id)
                    session = self.sessions.get(key)
                    if session is not None and session.history.length == request.history.length:
                        self.cache.plan(key, session, draft, e.k, request, e.want_probs)
        self.metrics.add({"entries_drafted": len(served), "drafts": sum(served)})
        self.metrics.observe_all("entry_fresh", waits)

    def _draft_alone(self, request: DraftRequest, want_probs: bool):
        """One request's drafts, or the exception drafting it raised."""
        try:
            with self.device_lock:
                return self.drafter.draft([request], want_probs)[0]
        except Exception as exc:  # noqa: BLE001 - this entry fails, the others are served
            log.exception("drafting one request failed")
            self.metrics.inc("draft_errors")
            return exc

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
        self.metrics.add({"entries_drafted": 1, "drafts": len(tokens)})

    # -- lifetime of requests --------------------------------------------------------------
    def _release(self, key: Key) -> None:
        if self.recorder is not None:
            self.recorder.forget(key)
        if (session := self.sessions.pop(key, None)) is not None:
            session.history.release()
            usage = self.peers[key[0]]
            usage.requests -= 1
            if not usage.requests:
                del self.peers[key[0]]
        if self.cache is not None:
            self.cache.forget(key)

    def _expire_idle(self) -> None:
        now = time.monotonic()
        cutoff = now - self.config.idle_timeout_s
        for key in [k for k, s in self.sessions.items() if s.last_used < cutoff]:
            self._release(key)
            self.metrics.inc("idle_releases")
        # no request held can time out before the least recently used one does (a request
        # used since, or opened since, times out later)
        self._expiry_due = min((s.last_used for s in self.sessions.values()), default=now) \
            + self.config.idle_timeout_s

    def expire_idle(self) -> None:
        with self.state_lock:
            self._expire_idle()

    def stats(self) -> dict:
        with self.state_lock:
            open_requests = len(self.sessions)
            cache_bytes = self.cache.nbytes if self.cache is not None else 0
            client_ids: dict[str, set[int]] = {}
            for peer, client, _ in self.sessions:
                client_ids.setdefault(peer, set()).add(client)
            peers = {self._label(p): {"requests": u.requests,
                                      "history_bytes": u.requests * self.bytes_per_request,
                                      "quota_refusals": u.quota_refusals,
                                      "client_ids": len(client_ids[p])}
                     for p, u in self.peers.items()}
            r = self.recorder
            recording = {} if r is None else {
                "gate_rounds_recorded": len(r.done), "gate_rounds_pending": len(r.pending),
                "gate_rounds_written": r.written, **({"gate_rounds_error": r.error} if r.error else {})}
        admission = {} if self.admission is None else {"admission": self.admission}
        return {"open_requests": open_requests, "spec_cache_bytes": cache_bytes,
                "peers_holding_requests": len(peers), "peers": peers, **admission, **recording,
                **self.metrics.snapshot(), **self.describe()}

    def _label(self, peer: str) -> str:
        return hashlib.blake2b(peer.encode(), digest_size=4, key=self._label_key).hexdigest()
