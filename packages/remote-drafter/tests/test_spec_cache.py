"""The speculation cache: a hit's drafts equal fresh drafts for the same committed tokens;
on the target's own copy every round after the first hits (all are fully accepted); its
memory and compute stay within their bounds; a remote worker with the cache on stays exact."""

import time

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.decode_loop import plain_decode, speculative_decode
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.transport import LocalTransport, RemoteTransport
from remote_drafter.models.llama import LlamaLM
from remote_drafter.models.registry import load_drafter
from remote_drafter.testing import WorkerProcess
from remote_drafter.worker.service import DraftService, ServiceConfig
from remote_drafter.worker.shadow_parity import ShadowClient
from remote_drafter.worker.speculation_cache import outcomes

PROMPTS = {1: [1, 2, 3, 4, 5], 2: [9, 8, 7, 6], 3: list(range(10, 30))}


def cached_client(models, spec, outcomes_per_round=3, cache_bytes=64 << 20, want_probs=False):
    service = DraftService(load_drafter(spec, models["target"]),
                           ServiceConfig(spec_cache=True, spec_cache_outcomes=outcomes_per_round,
                                         spec_cache_bytes=cache_bytes, spec_cache_max_batch=8))
    return DrafterClient(LocalTransport(service), "8:4", want_probs=want_probs), service


@pytest.mark.parametrize("spec, temperature", [("lm", 0.0), ("lm", 1.0), ("wrong", 0.0),
                                               ("dspark-tokens", 1.0)])
def test_hits_draft_what_a_fresh_round_drafts(models, spec, temperature):
    spec = {"wrong": "remote_drafter.testing:WrongEveryThird"}.get(spec, models.get(spec, spec))
    cached, service = cached_client(models, spec, outcomes_per_round=4, want_probs=True)
    fresh, _ = cached_client(models, spec, outcomes_per_round=0, want_probs=True)  # every round a miss
    shadow = ShadowClient(cached, fresh)
    probs_equal = []

    def after_round(drafts):
        service.cache.drain()  # a verification long enough for the whole budget

    def propose(k=None):  # tokens and probabilities, every round
        a, b = cached.propose(k), fresh.propose(k)
        probs_equal.extend(np.array_equal(a[r].probs, b[r].probs) for r in a if r in b)
        shadow.parity.compared += len(a)
        shadow.parity.identical += sum(np.array_equal(a[r].tokens, b[r].tokens) for r in a if r in b)
        return a

    shadow.propose = propose
    target = LlamaLM.load(models["target"])
    speculative_decode(target, shadow, PROMPTS, 24, temperature, on_round=after_round)
    stats = service.stats()
    assert shadow.parity.compared > 0 and shadow.parity.identical == shadow.parity.compared
    assert probs_equal and all(probs_equal)
    assert stats["spec_cache_hits"] > 0 and cached.counters()["cache_hits"] == stats["spec_cache_hits"]


def test_on_the_targets_copy_every_round_after_the_first_hits(models):
    client, service = cached_client(models, "lm", outcomes_per_round=1)
    target = LlamaLM.load(models["target"])
    result = speculative_decode(target, client, {1: [3, 1, 4, 1, 5]}, 30,
                                on_round=lambda d: service.cache.drain())
    stats = service.stats()
    fully_accepted = sum(a == d for a, d in zip(result.accepted, result.drafted))
    assert fully_accepted == len(result.accepted)  # the copy: every round
    assert stats["spec_cache_hits"] == result.steps - 1  # the first round is an open
    assert stats["spec_cache_misses"] == 0
    assert result.tokens[1] == plain_decode(target, [3, 1, 4, 1, 5], 30)


def test_correction_outcomes_hit_too(models):
    """A drafter wrong at every third position never has 4 drafts fully accepted, so every
    hit it gets comes from a planned (accepted length, correction) outcome."""
    client, service = cached_client(models, "remote_drafter.testing:WrongEveryThird", outcomes_per_round=3)
    target = LlamaLM.load(models["target"])
    result = speculative_decode(target, client, PROMPTS, 40, on_round=lambda d: service.cache.drain())
    assert not any(a == d == 4 for a, d in zip(result.accepted, result.drafted))
    assert service.stats()["spec_cache_hits"] > 0
    assert result.tokens == {rid: plain_decode(target, p, 40) for rid, p in PROMPTS.items()}


def test_memory_and_compute_stay_bounded(models):
    bound = 300  # bytes: a handful of drafts
    client, service = cached_client(models, "lm", outcomes_per_round=2, cache_bytes=bound)
    target = LlamaLM.load(models["target"])
    sizes = []

    def after_round(drafts):
        service.cache.drain()
        sizes.append(service.cache.nbytes)

    result = speculative_decode(target, client, PROMPTS, 20, on_round=after_round)
    stats = service.stats()
    assert max(sizes) <= bound and stats["spec_cache_evictions"] > 0
    rounds_drafted = stats["entries_drafted"]
    assert stats["spec_cache_predrafts"] <= 2 * rounds_drafted
    assert result.steps > 0


def test_large_rounds_skip_the_cache_and_draft_batched(models):
    service = DraftService(load_drafter("lm", models["target"]),
                           ServiceConfig(spec_cache=True, spec_cache_max_batch=2))
    client = DrafterClient(LocalTransport(service), "8:4")
    target = LlamaLM.load(models["target"])
    result = speculative_decode(target, client, PROMPTS, 12, on_round=lambda d: service.cache.drain())
    stats = service.stats()
    assert stats["spec_cache_hits"] == stats["spec_cache_misses"] == stats["spec_cache_predrafts"] == 0
    assert result.tokens == {rid: plain_decode(target, p, 12) for rid, p in PROMPTS.items()}


def test_outcomes_are_ranked_by_the_drafters_own_probabilities():
    from remote_drafter.models.base import Draft
    d = Draft(np.array([5, 6, 7, 8], np.int32), None, np.array([0.9, 0.5, 0.8, 0.7], np.float32),
              np.array([1, 2, 3, 4], np.int32), np.array([0.05, 0.4, 0.1, 0.2], np.float32))
    found = outcomes(d, 3, budget=3)
    assert found[0].tokens == (5, 6, 7, 8)  # all accepted + the drafter's own next token first
    assert found[0].probability == pytest.approx(0.9 * 0.5 * 0.8 * 0.7)
    assert [o.tokens for o in found[1:]] == [(5, 2), (1,)]  # 0.9*0.4 = .36, 1*0.05 = .05 > .045
    assert len(outcomes(d, 3, budget=1)) == 1


def test_a_remote_worker_with_the_cache_stays_exact_and_hits(models):
    worker = WorkerProcess("lm", models["target"], "tcp", 0, "--spec-cache", "--spec-cache-max-batch", "8")
    try:
        client = DrafterClient(RemoteTransport(worker.address, "tcp", expectation(models["target"], None)),
                               "8:4", deadline_s=10)
        target = LlamaLM.load(models["target"])
        result = speculative_decode(target, client, PROMPTS, 24, on_round=lambda d: time.sleep(0.05))
        assert result.tokens == {rid: plain_decode(target, p, 24) for rid, p in PROMPTS.items()}
        assert client.counters()["cache_hits"] > 0
    finally:
        worker.stop()
