"""RemoteProposer: vLLM's `custom_class` proposer, drafting through a DrafterClient.

    --speculative-config '{"method":"custom_class",
                           "model":"remote_drafter.vllm.RemoteProposer",
                           "num_speculative_tokens":5}'

Contract (vLLM calls `__init__`, `load_model`, `propose`; the hooks call the rest):
`propose` returns each row's drafts now (synchronous) or submits one round and returns
nothing (asynchronous), which `take_rows` later turns into placeholders of the promised
count (deferred collection, REMOTE_DRAFTER_VLLM_COLLECT=input) or the round's drafts;
`fill` writes a deferred round's drafts into the next step's inputs. Under tensor
parallelism only TP rank 0 holds a client; `fill` broadcasts its drafts to the other ranks.
Any failure means no drafts this step (deferred: placeholders); vLLM verifies what it gets,
so its output never changes. The whole story: ARCHITECTURE.md § Drafting data path.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np

from remote_drafter import env
from remote_drafter.engine.metrics import Metrics

from .client_factory import make_client, remote_async
from .tensor_parallel import agree, broadcast_drafts, from_first_rank, shared_group, tp_group
from .versions import DEFERRED_SOURCES, refusal

log = logging.getLogger("remote_drafter.vllm")
START_DEADLINE_S = 10.0  # asking the worker which layers its drafter reads, at start-up
# What a deferred round's drafts are until its reply is written in: any token id is safe,
# since verification accepts a draft only where it equals the target's own choice.
PLACEHOLDER = 0
COUNTERS = {
    "rounds_deferred": "Async rounds whose drafts went into the next step's inputs",
    "rounds_taken": "Async rounds collected when vLLM took the drafts",
    "drafts_filled": "Draft tokens written into the input batch by deferred collection",
    "placeholders_verified": "Placeholder drafts left for verification (round late, failed or short)",
    "hidden_rows_copied": "Hidden rows copied to the host (each request's newest window at most)",
}
HISTOGRAMS = {"engine_blocked": "The engine thread's time in the drafter per step (its propose, take "
                                "and fill): what drafting cost the step, network waits included",
              "host_gap": "Deferred round: submission to the next step's input preparation",
              "collect_wait": "Deferred round: time input preparation waited for the reply",
              "tp_broadcast": "Deferred drafts to every TP rank: time in the broadcast (ranks > 0: "
                              "with the wait for rank 0's collection)"}


def engine_time(method):
    """Adds the engine thread's time in `method` to the step's blocked time."""
    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._blocked += time.perf_counter() - started
    return timed


class RemoteProposer:
    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.tp = tp_group(vllm_config)
        if self.tp is not None:  # first, before any rank can fail or wait on its own
            agree(self.tp, drafting_settings())
        self.group, why = shared_group(vllm_config)  # the TP group rank 0's rounds serve
        if why:
            log.error("one round per TP group refused (%s): every rank runs its own rounds", why)
        # only TP rank 0 talks to the worker (with one rank, or the group refused: each rank)
        self.client = make_client() if self.group is None or self.group.rank_in_group == 0 else None
        self.ids: dict[str, int] = {}      # vLLM request id -> the client's integer id
        self.known: dict[str, int] = {}    # vLLM request id -> tokens the client has
        self.req_ids: list[str] | None = None  # this step's rows (from the plugin)
        self._pending = None  # async: (rows, {row: client id}, k) of the round in flight
        self._deferred = None  # ({request id: client id}, submitted at) awaiting the next inputs
        self._next_id = 1
        self.hidden_layers: tuple[int, ...] = ()  # set in load_model
        # rows a request keeps: the worker's window once it has said (load_model), else
        # the client's bound on history
        self.window = self.client.history_tokens if self.client else 0
        self.carry: dict[str, list[np.ndarray]] = {}  # committed rows not yet sent, per request
        self.rows_held_peak = 0  # the most hidden rows this rank held at once
        self._blocked, self._stepped = 0.0, False  # the step's time in propose, take and fill
        self.metrics = Metrics("remote_drafter_vllm", COUNTERS, HISTOGRAMS)
        self.defer = self._defer_allowed(vllm_config)
        self.http = self._serve_metrics(vllm_config)
        log.info("remote drafter proposer: k=%d, %s%s", self.k,
                 self.client.transport_name if self.client else "no client (TP rank 0's rounds)",
                 ", deferred collection" if self.defer else "")

    def _defer_allowed(self, vllm_config) -> bool:
        """The same on every rank (from the environment and vLLM's code): ranks > 0 join
        rank 0's broadcast exactly when it sends one."""
        if not remote_async() or env.REMOTE_DRAFTER_VLLM_COLLECT.get() == "take":
            return False
        parallel = vllm_config.parallel_config
        why = refusal(DEFERRED_SOURCES)
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1 and self.group is None:
            # each rank's own round could fail where another's succeeds: inputs would differ
            why = "tensor/pipeline parallel ranks run their own rounds"
        if why:
            log.error("deferred collection refused (%s): async rounds are collected at take", why)
        return why is None

    def _serve_metrics(self, vllm_config):
        listen = env.REMOTE_DRAFTER_METRICS_LISTEN.get()
        if not listen:
            return None
        from ofl.http import MetricsServer
        from ofl.server import parse_address
        rank = vllm_config.parallel_config.rank
        host, port = parse_address(listen, 9494)
        try:
            return MetricsServer(host, port + rank,
                                 lambda: (self.client.prometheus() if self.client else "") + self.metrics.prometheus(),
                                 lambda: {"rank": rank, "client": self.client.counters() if self.client else {},
                                          "workers": self.client.workers() if self.client else [],
                                          "proposer": self.metrics.snapshot(),
                                          "hidden_rows_held": self.rows_held(),
                                          "hidden_rows_held_peak": self.rows_held_peak},
                                 name=f"remote-drafter-r{rank}")
        except OSError as exc:  # the counters stay unreadable; drafting is unaffected
            log.error("remote drafter counters not served on %s: %s", listen, exc)
            return None

    def load_model(self, target_model=None, *args, **kwargs) -> None:
        """Learn which target layers the drafter reads (the plugin then has vLLM output
        them on every rank alike: rank 0's answer is shared). Local mode: the drafter uses
        the engine's own embedding and head (the same values it read from the checkpoint)
        instead of a second copy."""
        if self.client is not None:
            self.hidden_layers = self._hidden_layers()
        if self.group is not None:
            self.hidden_layers, self.window = from_first_rank(self.group, (self.hidden_layers, self.window))
        if self.client is None:  # rank 0's rounds: this rank sends no rows
            return
        self.client.hidden_layers = self.hidden_layers
        if self.hidden_layers:
            log.warning("remote drafter reads the target's hidden rows of layers %s",
                        list(self.hidden_layers))
        model = getattr(self.client.local_drafter, "model", None)
        if target_model is None or model is None or not hasattr(model, "embed"):
            return
        try:
            embed = target_model.model.embed_tokens.weight
            head = getattr(getattr(target_model, "lm_head", None), "weight", embed)
        except AttributeError:
            log.warning("target model has no embed_tokens: the local drafter keeps its own copy")
            return
        vocab, width = model.embed.shape
        for name, mine, theirs in (("embed", model.embed, embed), ("head", model.head, head)):
            if theirs.shape[0] < vocab or theirs.shape[1] != width or theirs.dtype != mine.dtype \
                    or theirs.device != mine.device:
                log.warning("the engine's %s (%s %s) does not fit the drafter's (%s %s): keeping "
                            "its own copy", name, tuple(theirs.shape), theirs.dtype, tuple(mine.shape), mine.dtype)
                return
        saved = {p.data_ptr(): p.numel() * p.element_size() for p in (model.embed, model.head)}
        model.embed, model.head = embed[:vocab], head[:vocab]
        log.warning("local drafter shares the engine's embedding and head (%d bytes not duplicated)",
                    sum(saved.values()))

    def _hidden_layers(self) -> tuple[int, ...]:
        configured = env.REMOTE_DRAFTER_HIDDEN_LAYERS.get().strip()
        if configured not in ("", "auto"):
            return tuple(int(x) for x in configured.split(","))
        try:
            info = self.client.worker_info(START_DEADLINE_S)
        except Exception as exc:  # noqa: BLE001 - no worker at start-up
            log.error("cannot ask the worker which target layers its drafter reads (%s): rounds "
                      "carry no hidden rows; a drafter that needs them drafts nothing. Set "
                      "REMOTE_DRAFTER_HIDDEN_LAYERS to start without asking.", exc)
            return ()
        self.window = info.window
        return tuple(info.hidden_layers)

    def set_batch(self, req_ids: list[str], finished, rows: dict | None = None) -> None:
        """From the plugin, before propose: this step's rows (request ids) and, for a
        drafter that reads hidden states, the rows of what each request committed. Once a
        step: the time the last step spent in the drafter is observed here."""
        if self._stepped:
            self.metrics.observe("engine_blocked", self._blocked)
        self._blocked, self._stepped = 0.0, True
        self.req_ids = req_ids
        for rid in finished or ():
            self._forget(rid)
        for rid, r in (rows or {}).items():
            if len(r):
                held = self.carry.setdefault(rid, [])
                held.append(r)
                if sum(map(len, held)) > self.window:  # a window per request, whatever the prompt
                    self.carry[rid] = [np.concatenate(held)[-self.window:]]
                self.metrics.inc("hidden_rows_copied", len(r))
        if rows:
            self.rows_held_peak = max(self.rows_held_peak, self.rows_held())

    @property
    def sends_rows(self) -> bool:
        """This rank sends the target's hidden rows (TP rank 0 of a drafter that reads them)."""
        return self.client is not None and bool(self.hidden_layers)

    def rows_held(self) -> int:
        """Hidden rows this rank holds: those copied but not yet sent, and the client's."""
        carried = sum(len(r) for held in self.carry.values() for r in held)
        return carried + (self.client.rows_held() if self.client else 0)

    def _forget(self, rid: str) -> None:
        self.carry.pop(rid, None)
        if rid in self.ids:
            self.client.release(self.ids.pop(rid))
            self.known.pop(rid, None)

    def _track(self, rid: str, tokens: np.ndarray) -> int:
        """Add the request or commit what it gained since the last step, with the hidden
        rows committed since (all but the newest token's: they lag by one)."""
        n = len(tokens)
        carried = self.carry.pop(rid, None)
        rows = np.concatenate(carried) if carried and self.hidden_layers else None
        # new, reset (preempted), or gained more tokens than the window of rows held: open
        # from the tokens and the window (what the worker keeps of a longer history anyway)
        if rid not in self.ids or n < self.known[rid] or \
                (rows is not None and len(rows) < n - self.known[rid]):
            self._forget(rid)
            self.ids[rid] = self._next_id
            self._next_id += 1
            self.client.add_request(self.ids[rid], tokens, rows)
        elif n > self.known[rid]:
            self.client.commit(self.ids[rid], tokens[self.known[rid]:], rows)
        self.known[rid] = n
        return self.ids[rid]

    @engine_time
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        rows = len(sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(rows)]
        if self.client is None:  # TP rank > 0: rank 0's drafts are the ones vLLM takes
            return out
        if self.req_ids is None:
            log.error("the remote_drafter vLLM plugin is not loaded: no request ids, no drafts")
            return out
        try:
            wanted = {}
            for i in range(rows):
                n = int(num_tokens_no_spec[i])
                if not len(sampled_token_ids[i]) or n >= self.max_model_len:
                    continue  # no proposal for this row this step (as vLLM's n-gram proposer)
                wanted[i] = self._track(self.req_ids[i], np.asarray(token_ids_cpu[i, :n], np.int32))
            live = set(self.req_ids[:rows])
            for rid in [r for r in self.ids if r not in live]:
                self._forget(rid)
            k = min(self.k, self.client.depth(None))
            if not wanted or k == 0:
                return out
            if self.client.asynchronous:
                # Submitted now, collected when vLLM takes the drafts (after the scheduler
                # update and output handling): the round overlaps that engine work.
                if self.client.submit(k):
                    self._pending = (rows, wanted, k)
                return out
            return self._rows(rows, wanted, self.client.propose(k))
        except Exception:  # noqa: BLE001 - never break the engine: no drafts this step
            log.exception("remote drafter proposer failed; no drafts this step")
        return out

    def _rows(self, rows: int, wanted: dict, drafts: dict) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(rows)]
        for i, cid in wanted.items():
            d = drafts.get(cid)
            if d is not None:
                out[i] = [int(t) for t in d.tokens[:self.k]]
        return out

    @engine_time
    def take_rows(self, structured: bool = False) -> list[list[int]] | None:
        """Async mode, when vLLM takes the drafts: placeholders of the promised count per row
        (deferred), or the round's drafts (bounded wait); None if no round. `structured`: a
        request of the batch has structured output, whose drafts the scheduler checks
        against its grammar, so they must be real now."""
        if self._pending is None:
            return None
        rows, wanted, k = self._pending
        self._pending = None
        if self.defer and not structured:
            self._deferred = ({self.req_ids[i]: cid for i, cid in wanted.items()},
                              self.client.submitted_at() or time.perf_counter())
            return [[PLACEHOLDER] * k if i in wanted else [] for i in range(rows)]
        self.metrics.inc("rounds_taken")
        try:
            return self._rows(rows, wanted, self.client.collect())
        except Exception:  # noqa: BLE001
            log.exception("collecting remote drafts failed; no drafts this step")
            return [[] for _ in range(rows)]

    @engine_time
    def fill(self, batch, scheduled: dict[str, list[int]]) -> None:
        """After the next step's _update_states: the deferred round's drafts over the
        placeholders the scheduler sent back, in the token ids _prepare_inputs gathers and in
        the spec ids the sampler reads (penalties, bad words). Under one round per TP group
        every rank, when drafts are scheduled, takes rank 0's in one broadcast."""
        drafts = {}
        if self.client is not None:
            try:
                drafts = self._collect(scheduled)
            except Exception:  # noqa: BLE001 - never break the engine: placeholders stay
                log.exception("collecting deferred drafts failed; placeholders are verified")
        if self.group is not None and self.defer and any(scheduled.values()):
            started = time.perf_counter()
            drafts = broadcast_drafts(self.group, drafts, scheduled)
            self.metrics.observe("tp_broadcast", time.perf_counter() - started)
        for rid, tokens in drafts.items():
            index = batch.req_id_to_index.get(rid)
            if index is not None:
                start = int(batch.num_tokens_no_spec[index])
                batch.token_ids_cpu[index, start:start + len(tokens)] = tokens
                batch.spec_token_ids[index][:len(tokens)] = tokens  # in place: the sampler holds it

    def _collect(self, scheduled: dict[str, list[int]]) -> dict[str, list[int]]:
        """The deferred round's drafts (its deadline bounds the wait), each as long as what
        was scheduled for its request: what the round lacks stays a placeholder, counted."""
        if self._deferred is None:
            return {}
        cids, submitted = self._deferred
        self._deferred = None
        started = time.perf_counter()
        self.metrics.inc("rounds_deferred")
        self.metrics.observe("host_gap", started - submitted)
        drafts = self.client.collect()
        self.metrics.observe("collect_wait", time.perf_counter() - started)
        out, filled = {}, 0
        for rid, cid in cids.items():
            want = scheduled.get(rid)
            if want:
                d = drafts.get(cid)
                tokens = [int(t) for t in d.tokens[:len(want)]] if d is not None else []
                out[rid] = tokens + list(want[len(tokens):])
                filled += len(tokens)
        self.metrics.inc("drafts_filled", filled)
        self.metrics.inc("placeholders_verified", sum(map(len, out.values())) - filled)
        return out


def drafting_settings() -> dict:
    """How this engine rank drafts, from its own environment: what every TP rank must
    share (the worker's address may differ by host; only rank 0 uses it)."""
    return {"remote": bool(env.REMOTE_DRAFTER_ADDRESS.get()), "asynchronous": remote_async(),
            "collection": env.REMOTE_DRAFTER_VLLM_COLLECT.get(),
            "hidden_layers": env.REMOTE_DRAFTER_HIDDEN_LAYERS.get().strip() or "auto",
            "local_drafter": env.REMOTE_DRAFTER_DRAFTER.get(),
            "capacity_mode": env.capacity_mode()}
