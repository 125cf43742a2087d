"""The engine side: track requests, build one round per step, fail closed.

    client = DrafterClient(RemoteTransport("10.0.0.2:7490", expect=expectation(target, None)))
    client.add_request(7, prompt_and_first_token, hidden_rows)   # after prefill
    drafts = client.propose()          # {7: Drafts(tokens=[...])}; {} when the worker is gone
    client.commit(7, accepted_plus_next, their_hidden_rows)      # after verification

Torch-free: hidden rows may be numpy arrays or tensors (copied to the host as they are:
a bf16 engine's rows stay bf16, engine/rows.py). The client keeps each request's bounded history, so when the worker lost its state
(restart, idle timeout) or a round failed half-way, the request is re-opened from it and
drafts continue exactly as before. No reply, a late reply or any error means no drafts
this step, counted; the output never changes, only the speed.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from dataclasses import dataclass

import numpy as np

from remote_drafter import env

from . import protocol as P
from .history import History
from .identity import Manifest
from .metrics import Metrics
from .rows import as_rows

log = logging.getLogger("remote_drafter.engine.client")
LOG_EVERY_S = 10.0

COUNTERS = {
    "rounds": "Rounds sent (sync calls and async submissions)",
    "rounds_ok": "Rounds answered",
    "rounds_failed": "Rounds that failed whole (deadline, link, refusal, bad reply): no drafts",
    "steps_without_drafts": "Steps that got no drafts because of a failure",
    "entries_failed": "Request entries without drafts because of an error status",
    "reopens": "Requests re-opened from the client's history (worker lost state)",
    "capacity_refusals": "Opens the worker refused because it was full",
    "quota_refusals": "Opens the worker refused because this host (its address) holds its quota there",
    "drafts": "Draft tokens received",
    "cache_hits": "Entries the worker answered from its speculation cache",
    "async_abandoned": "Async rounds superseded before they were collected",
    "opens_deferred": "Entries left for a later step because the round was full (message size)",
    "opens_too_large": "Opens larger than a whole round can carry (raise the message/slot size)",
    "drafts_skipped_reply_size": "Entries sent with k = 0 because their drafts (probabilities) would overflow the reply",
    "request_bytes": "Bytes of round requests sent",
    "committed_tokens": "Committed tokens sent to the worker",
    "rows_sent": "Hidden rows sent to the worker (an open sends one window at most)",
    "row_bytes_sent": "Bytes of hidden rows sent, in the drafter's compute dtype",
    "worker_failovers": "Times rounds moved to another worker of the pool (REMOTE_DRAFTER_STANDBYS)",
}


@dataclass
class Drafts:
    tokens: np.ndarray            # int32 [n <= k]
    probs: np.ndarray | None      # float32 [n, vocab] when asked for
    cache_hit: bool = False


class DepthTable:
    """Batch-aware depth: '1:5,8:4,16:3' -> 5 drafts up to 1 running request, 4 up to 8,
    3 up to 16, none beyond (verification costs more than drafts save at large batch)."""

    def __init__(self, spec: str):
        try:
            pairs = sorted((int(a), int(b)) for a, b in (p.split(":") for p in spec.split(",") if p))
        except ValueError:
            raise ValueError(f"depth table {spec!r}: expected 'running:k' pairs like '1:5,8:4'") from None
        if not pairs or any(b < 0 for _, b in pairs):
            raise ValueError(f"depth table {spec!r} is empty or has a negative depth")
        self.pairs = pairs

    def depth(self, running: int) -> int:
        for bound, k in self.pairs:
            if running <= bound:
                return k
        return 0


class WorkerInfo:
    def __init__(self, described: dict):
        d = described["drafter"]
        self.feature, self.max_depth, self.vocab = int(d["feature"]), int(d["max_depth"]), int(d["vocab_size"])
        self.window, self.history_tokens = int(d["window"]), int(d["history_tokens"])
        self.hidden_layers = tuple(d.get("hidden_layers", ()))
        # rows travel in the type the drafter computes in (what it casts them to anyway)
        self.row_dtype = d.get("dtype") if d.get("dtype") in P.ROW_DTYPES else "float32"
        self.manifest = Manifest.from_json(described["manifest"])
        self.fingerprint = self.manifest.fingerprint
        self.described = described


@dataclass
class _Request:
    history: History
    temperature: float
    seed: int
    # committed since the worker last got them: the history's newest tokens and rows, sent
    # from it (a continue), or, once they outgrow what it keeps, re-opened
    pending_tokens: int = 0
    pending_rows: int = 0
    needs_open: bool = True
    deferred: int = 0  # when it was first left out of a full round (0: not waiting)
    too_large_logged: bool = False


class DrafterClient:
    """One per engine (per TP rank): its own client id namespaces its requests on a worker
    that several engines share."""

    def __init__(self, transport, depth: DepthTable | str | None = None, *,
                 deadline_s: float | None = None, want_probs: bool = False,
                 row_dtype: str | None = None, history_tokens: int = 4096, window: int = 128,
                 max_pending_releases: int = 4096, client_id: int | None = None):
        self.transport = transport
        self.depth_table = DepthTable(depth or env.REMOTE_DRAFTER_DEPTH.get()) \
            if not isinstance(depth, DepthTable) else depth
        self.deadline_s = deadline_s or env.REMOTE_DRAFTER_DEADLINE_MS.get_float() / 1000
        # None: the drafter's compute dtype, once the worker has described it
        self.want_probs, self.fixed_row_dtype = want_probs, row_dtype
        self.row_dtype = row_dtype or "float32"
        self.history_tokens, self.window = history_tokens, window
        self.client_id = client_id if client_id is not None else secrets.randbits(32)
        self.requests: dict[int, _Request] = {}
        self.releases: list[int] = []
        self.max_pending_releases = max_pending_releases
        self.metrics = Metrics("remote_drafter_client", COUNTERS, {"round": "Round latency"})
        self._inflight = None  # async: (ticket, entries, info, started)
        self._last_warning, self._suppressed = -LOG_EVERY_S, 0
        self._deferrals = itertools.count(1)
        self._adopted = False  # histories sized from a worker's description yet
        self.hidden_layers: tuple | None = None  # the layers of the rows it sends, once known

    # -- the engine's view of its requests --------------------------------------------------
    def add_request(self, rid: int, tokens, hidden=None, temperature: float = 0.0, seed: int = 0) -> None:
        """A request after prefill: its tokens (prompt + first sampled token) and the target's
        hidden rows of all but the newest token (or None for a token-only drafter)."""
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature {temperature} is not a finite value >= 0")
        if rid in self.releases:  # an id reused before its release went out: the open resets it
            self.releases.remove(rid)
        if (replaced := self.requests.pop(rid, None)) is not None:
            replaced.history.release()
        rows = as_rows(hidden)
        # Until the worker has said how many rows it looks at, keep them all (trimmed then).
        window = self.window if self._adopted else self.history_tokens
        history = History(self.history_tokens, window, 0, np.float32) if rows is None else \
            History(self.history_tokens, window, rows.shape[1], rows.dtype)  # rows kept as given
        history.reset(np.asarray(tokens, np.int32).reshape(-1), rows)
        self.requests[rid] = _Request(history, float(temperature), int(seed) & (2**64 - 1))

    def commit(self, rid: int, tokens, hidden=None) -> None:
        """Tokens committed by a verification (accepted drafts + the next token) and the
        hidden rows that pass produced for them (the previous newest token's and the
        accepted drafts': one per token)."""
        r = self.requests[rid]
        tokens, rows = np.asarray(tokens, np.int32).reshape(-1), as_rows(hidden)
        r.history.extend(tokens, rows)
        if r.needs_open:
            return  # the next round re-opens from the history anyway
        r.pending_tokens += len(tokens)
        r.pending_rows += 0 if rows is None else len(rows)
        if not self._pending_held(r):
            r.needs_open, r.pending_tokens, r.pending_rows = True, 0, 0

    @staticmethod
    def _pending_held(r: _Request) -> bool:
        """Whether the history still holds everything committed since the last round."""
        return r.pending_tokens <= len(r.history.tokens) and r.pending_rows <= r.history.row_count

    def release(self, rid: int) -> None:
        if (r := self.requests.pop(rid, None)) is not None:
            r.history.release()
            self.releases.append(rid)
            del self.releases[:-self.max_pending_releases]  # the worker's idle timeout covers the rest

    # -- building and reading rounds ---------------------------------------------------------
    def _adopt(self, info: WorkerInfo) -> None:
        """Keep at least what the worker looks at, so re-opens can always recreate its state.
        Refuses a worker that reads other target layers than the rows this engine sends."""
        if self.hidden_layers is not None and info.hidden_layers != self.hidden_layers:
            raise ValueError(f"the worker's drafter reads target layers {list(info.hidden_layers)}, "
                             f"this engine sends rows of {list(self.hidden_layers)}")
        self.row_dtype = self.fixed_row_dtype or info.row_dtype
        if self._adopted and info.window <= self.window and info.history_tokens <= self.history_tokens:
            return
        if self._adopted:
            log.warning("a worker that keeps more (%d rows, %d tokens) than the one before: "
                        "requests opened before may be refused on re-open", info.window, info.history_tokens)
            self.window = max(self.window, info.window)
            self.history_tokens = max(self.history_tokens, info.history_tokens)
        else:  # the first worker's bounds replace the defaults: rows beyond its window are waste
            self.window, self.history_tokens = info.window, info.history_tokens
        for r in self.requests.values():
            r.history.window, r.history.max_tokens = self.window, self.history_tokens
            if r.history.rows is not None:
                r.history.rows = r.history.rows[-self.window:]
            if not self._pending_held(r):  # the trimmed history no longer holds what waits
                r.needs_open, r.pending_tokens, r.pending_rows = True, 0, 0
        self._adopted = True

    def _reply_bytes(self, k: int, info: WorkerInfo) -> int:
        return P.reply_entry_bytes(k, info.vocab if self.want_probs else 0)

    def _entries(self, k: int, info: WorkerInfo) -> list[P.Entry]:
        """This step's entries, within the link's message size both ways. Requests left out
        before go first (oldest first, so a large open cannot starve), then continues, then
        new opens; an entry whose request does not fit waits for a later step (counted), one
        whose drafts would not fit the reply just records its tokens (k = 0, counted). A
        continue left out stays a continue (its tokens and rows wait, and it goes first next
        step): turning it into a re-open would make it a window's rows larger, and with
        large opens in flight that churns, each step re-opening what the last one left out."""
        entries = [P.Entry(rid, P.OP_RELEASE) for rid in self.releases]
        self.releases = []
        limit = self.transport.max_round_bytes
        k = min(k, info.max_depth)
        # every entry's reply has k drafts or none: its size is one of two, worked out once
        with_drafts, status_only = self._reply_bytes(k, info), self._reply_bytes(0, info)
        room = limit - P.REQUEST_HEADER.itemsize - P.ENTRY.itemsize * len(entries)
        reply_room = limit - P.REPLY_HEADER.itemsize - status_only * len(entries)
        waiting = sorted((r.deferred, rid) for rid, r in self.requests.items() if r.deferred)
        order = [rid for _, rid in waiting]
        order += [rid for rid, r in self.requests.items() if not r.deferred and not r.needs_open and r.pending_tokens]
        order += [rid for rid, r in self.requests.items() if not r.deferred and r.needs_open]
        for rid in order:
            r = self.requests[rid]
            e = self._entry(rid, r, k, info)
            size = P.entry_bytes(e, self.row_dtype)
            if size > room:
                if r.needs_open or size > limit - P.REQUEST_HEADER.itemsize:
                    r.needs_open, r.pending_tokens, r.pending_rows = True, 0, 0  # the history has it all
                r.deferred = r.deferred or next(self._deferrals)
                self.metrics.inc("opens_deferred")
                if size > limit - P.REQUEST_HEADER.itemsize and not r.too_large_logged:
                    r.too_large_logged = True
                    self.metrics.inc("opens_too_large")
                    log.error("request %d needs %d bytes to open, the link carries %d per round: "
                              "raise OFL_MAX_MESSAGE_BYTES (both sides) / ASYNC_HANDOFF_SLOT_BYTES",
                              rid, size, limit)
                continue
            if e.k and with_drafts > reply_room:
                e.k = 0
                self.metrics.inc("drafts_skipped_reply_size")
            room -= size
            reply_room -= with_drafts if e.k else status_only
            entries.append(e)
            r.needs_open, r.pending_tokens, r.pending_rows, r.deferred = False, 0, 0, 0
        return entries

    def _entry(self, rid: int, r: _Request, k: int, info: WorkerInfo) -> P.Entry:
        if r.needs_open:
            tokens, rows, length = r.history.open_payload()
            if info.feature and rows is not None:
                rows = rows[-min(len(tokens) - 1, info.window):] if len(tokens) > 1 else rows[:0]
            return P.Entry(rid, P.OP_OPEN, tokens, rows if info.feature else None, k,
                           r.temperature, r.seed, self.want_probs, length=length)
        # views of the history's newest tokens and rows (sent before it changes again)
        rows = r.history.newest_rows(r.pending_rows) if info.feature and r.pending_rows else None
        return P.Entry(rid, P.OP_CONTINUE, r.history.tokens[-r.pending_tokens:], rows, k,
                       want_probs=self.want_probs, length=r.history.length)

    def _encode(self, entries: list[P.Entry], info: WorkerInfo) -> list:
        """The round's request as its parts (protocol.request_parts)."""
        payload = P.request_parts(entries, info.fingerprint, self.row_dtype, client_id=self.client_id)
        sent = [e.rows for e in entries if e.rows is not None]
        self.metrics.add({"rounds": 1, "request_bytes": sum(len(p) for p in payload),
                          "committed_tokens": sum(len(e.tokens) for e in entries),
                          "rows_sent": sum(map(len, sent)),
                          "row_bytes_sent": sum(r.size for r in sent) * P.ROW_BYTES[P.ROW_DTYPES[self.row_dtype]]})
        return payload

    def _warn(self, message: str, *args) -> None:
        """One line per LOG_EVERY_S, saying how many were held back."""
        now = time.monotonic()
        if now - self._last_warning < LOG_EVERY_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} similar lines held back)" if self._suppressed else ""
        log.warning(message + more, *args)
        self._last_warning, self._suppressed = now, 0

    def _fail(self, entries: list[P.Entry] | None, why: str) -> dict:
        """No drafts this step. The worker's state for the round's requests (all requests
        when unknown) is unknown now: re-open them next round; re-send its releases."""
        self.metrics.inc("rounds_failed")
        self.metrics.inc("steps_without_drafts")
        rids = list(self.requests) if entries is None else [e.request_id for e in entries]
        for rid in rids:
            if rid in self.requests:
                self.requests[rid].needs_open = True
        for e in entries or []:
            if e.op == P.OP_RELEASE and e.request_id not in self.requests:
                self.releases.append(e.request_id)
        self.transport.invalidate()
        self._warn("draft round failed, no drafts this step: %s (%d failed rounds so far)",
                   why, self.metrics.value("rounds_failed"))
        return {}

    def _check(self, e: P.Entry, r: P.Reply, info: WorkerInfo, ids_checked: bool) -> None:
        """A reply entry must be one this request could get; else the whole reply is refused.
        ids_checked: the round's drafts are all in the vocabulary (one pass for all entries)."""
        n = len(r.tokens)
        if n > e.k or not (ids_checked or P.ids_in_vocab(r.tokens, info.vocab)):
            raise P.ProtocolError(f"reply for request {e.request_id} carries invalid drafts")
        if not (e.want_probs and n):
            return
        p = r.probs
        if p is None or p.shape != (n, info.vocab) or not np.isfinite(p).all() or (p < 0).any() \
                or not (p[np.arange(n), r.tokens] > 0).all():
            raise P.ProtocolError(f"reply for request {e.request_id} carries invalid probabilities")

    def _absorb(self, entries: list[P.Entry], replies: list[P.Reply], info: WorkerInfo) -> tuple[dict, list[int]]:
        """Drafts per request; also the requests the worker did not know (to re-open)."""
        if [r.request_id for r in replies] != [e.request_id for e in entries]:
            raise P.ProtocolError("reply entries do not match the request's")
        served = [(e, r) for e, r in zip(entries, replies) if r.status == P.STATUS_OK and e.op != P.OP_RELEASE]
        drafted = [r.tokens for _, r in served if len(r.tokens)]
        ids_checked = not drafted or P.ids_in_vocab(np.concatenate(drafted), info.vocab)
        for e, r in served:
            self._check(e, r, info, ids_checked)
        out, unknown, drafts, hits = {}, [], 0, 0
        for e, r in zip(entries, replies):
            if e.op == P.OP_RELEASE:
                continue
            if r.status == P.STATUS_OK:
                if e.k and len(r.tokens):
                    out[e.request_id] = Drafts(r.tokens, r.probs if e.want_probs else None,
                                               r.cache == P.CACHE_HIT)
                    drafts += len(r.tokens)
                    hits += r.cache == P.CACHE_HIT
                continue
            self.metrics.inc("entries_failed")
            if e.request_id in self.requests:
                self.requests[e.request_id].needs_open = True
            if r.status == P.STATUS_UNKNOWN:
                unknown.append(e.request_id)
            elif r.status == P.STATUS_CAPACITY:
                self.metrics.inc("capacity_refusals")
            elif r.status == P.STATUS_QUOTA:
                self.metrics.inc("quota_refusals")
            else:
                self._warn("request %d: worker answered %s: %s", e.request_id,
                           P.STATUS_NAMES[r.status], r.message)
        self.metrics.add({"drafts": drafts, "cache_hits": hits})  # once a round, not per entry
        return out, unknown

    def depth(self, k: int | None) -> int:
        return self.depth_table.depth(len(self.requests)) if k is None else k

    def _step_entries(self, k: int) -> tuple[WorkerInfo, list[P.Entry]] | None:
        """The worker's limits and this step's entries; None: no round this step (no worker,
        counted as a failed round, or nothing to send)."""
        moved = getattr(self.transport, "failovers", 0) - self.metrics.value("worker_failovers")
        if moved > 0:  # the link went to another worker of the pool since the last round
            self.metrics.inc("worker_failovers", moved)
        try:
            info = self.transport.info(self.deadline_s)
        except Exception as exc:  # noqa: BLE001 - no worker: target-only this step
            self._fail(None, f"no worker: {exc}")
            return None
        self._adopt(info)
        entries = self._entries(k, info)
        return (info, entries) if entries else None

    # -- synchronous rounds ------------------------------------------------------------------
    def propose(self, k: int | None = None) -> dict[int, Drafts]:
        """One round for every tracked request, within the deadline: {rid: Drafts}. Never
        raises: any failure means no drafts this step (counted)."""
        try:
            return self._propose(self.depth(k), time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - whatever broke, the engine decodes on
            return self._fail(None, f"{type(exc).__name__}: {exc}")

    def _propose(self, k: int, started: float) -> dict[int, Drafts]:
        if (step := self._step_entries(k)) is None:
            return {}
        info, entries = step
        out, unknown = self._round(entries, info, started)
        if unknown and time.perf_counter() - started < self.deadline_s / 2:
            # The worker lost these (restart, idle timeout, out of step): re-open them at
            # once from the history, within the same deadline, so the step keeps its drafts.
            self.metrics.inc("reopens", len(unknown))
            more, _ = self._round(self._entries_for(set(unknown), k, info), info, started)
            out.update(more)
        return out

    def _round(self, entries, info, started) -> tuple[dict, list[int]]:
        try:
            payload = self._encode(entries, info)
            left = max(self.deadline_s - (time.perf_counter() - started), 1e-3)
            out, unknown = self._absorb(entries, P.parse_reply(self.transport.call(payload, left)), info)
        except Exception as exc:  # noqa: BLE001 - deadline, link, refusal, bad reply: fail closed
            return self._fail(entries, f"{type(exc).__name__}: {exc}"), []
        self.metrics.inc("rounds_ok")
        self.metrics.observe("round", time.perf_counter() - started)
        return out, unknown

    def _entries_for(self, keep: set[int], k: int, info: WorkerInfo) -> list[P.Entry]:
        saved = {rid: r for rid, r in self.requests.items() if rid not in keep}
        self.requests = {rid: r for rid, r in self.requests.items() if rid in keep}
        try:
            return self._entries(k, info)
        finally:
            self.requests.update(saved)

    # -- asynchronous rounds (through async_handoff's proxy) ---------------------------------
    def submit(self, k: int | None = None) -> bool:
        """Start this step's round; collect() picks the drafts up later. False: no round.
        Never raises."""
        try:
            return self._submit(self.depth(k))
        except Exception as exc:  # noqa: BLE001
            self._inflight = None
            self._fail(None, f"{type(exc).__name__}: {exc}")
            return False

    def _submit(self, k: int) -> bool:
        if self._inflight is not None:
            ticket, entries = self._inflight[:2]
            self._inflight = None
            self.metrics.inc("async_abandoned")
            self._fail(entries, "superseded before it was collected")
            self.transport.abandon(ticket)
        if (step := self._step_entries(k)) is None:
            return False
        info, entries = step
        payload = self._encode(entries, info)
        try:
            ticket = self.transport.submit(payload)
        except ValueError as exc:  # larger than a handoff slot: ASYNC_HANDOFF_SLOT_BYTES too small
            self._fail(entries, f"{exc} (raise ASYNC_HANDOFF_SLOT_BYTES above {sum(len(p) for p in payload)})")
            return False
        if ticket is None:
            self._fail(entries, "the async handoff took no round (disabled or full)")
            return False
        self._inflight = (ticket, entries, info, time.perf_counter())
        return True

    def submitted_at(self) -> float | None:
        """When the round in flight was submitted (time.perf_counter); None without one."""
        return None if self._inflight is None else self._inflight[3]

    def collect(self) -> dict[int, Drafts]:
        """The drafts of the submitted round, waiting at most the handoff's max wait.
        Never raises."""
        if self._inflight is None:
            return {}
        ticket, entries, info, started = self._inflight
        self._inflight = None
        try:
            reply = self.transport.wait(ticket)
            if reply is None:
                return self._fail(entries, "no reply from the proxy in time")
            out, _ = self._absorb(entries, P.parse_reply(reply), info)  # unknown: re-open next round
        except Exception as exc:  # noqa: BLE001
            return self._fail(entries, f"{type(exc).__name__}: {exc}")
        self.metrics.inc("rounds_ok")
        self.metrics.observe("round", time.perf_counter() - started)
        return out

    # -- operations --------------------------------------------------------------------------
    def counters(self) -> dict:
        out = self.metrics.snapshot()
        tokens = out.get("committed_tokens", 0)
        out["request_bytes_per_token"] = out["request_bytes"] / tokens if tokens else 0.0
        return out

    def workers(self) -> list[dict]:
        """The worker pool as this client's link sees it (address, primary or standby, whether
        its rounds go there, why it last failed); empty in local mode."""
        pool = getattr(self.transport, "pool", None)
        return pool() if pool else []

    def rows_held(self) -> int:
        """Hidden rows the client holds: each request's window (what waits to be sent is its
        newest rows)."""
        return sum(r.history.row_count for r in self.requests.values())

    def prometheus(self) -> str:
        return self.metrics.prometheus()

    @property
    def asynchronous(self) -> bool:
        """Rounds are submitted now and collected later (through the proxy)."""
        return getattr(self.transport, "asynchronous", False)

    @property
    def transport_name(self) -> str:
        return type(self.transport).__name__

    @property
    def local_drafter(self):
        """The drafter itself in local mode (the engine's own process), else None."""
        return getattr(getattr(self.transport, "service", None), "drafter", None)

    def worker_info(self, deadline_s: float) -> WorkerInfo:
        """The worker's limits and the drafter's description (asked once, then cached);
        connects if need be, within `deadline_s` (start-up, status: not the engine's steps)."""
        return self.transport.info(deadline_s, connect=True)

    def close(self) -> None:
        self.transport.close()
