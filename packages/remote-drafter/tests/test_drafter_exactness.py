"""Exactness at T = 0: a target decoding with drafts (any drafter, local or remote, sync or
async, tcp or shm) produces exactly the tokens it produces alone (float32, CPU)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from async_handoff import HandoffConfig  # noqa: E402
from remote_drafter.decode_loop import plain_decode, speculative_decode  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.identity import expectation  # noqa: E402
from remote_drafter.engine.transport import AsyncTransport, LocalTransport, RemoteTransport  # noqa: E402
from remote_drafter.models.registry import load_drafter  # noqa: E402
from remote_drafter.testing import HIDDEN_LAYERS, WorkerProcess, WrongEveryThird  # noqa: E402
from remote_drafter.worker.service import DraftService  # noqa: E402

PROMPTS = {1: [1, 2, 3, 4, 5], 2: [9, 8, 7], 3: list(range(10, 40))}  # 3 is longer than the window
NEW = 24
SLOW = HandoffConfig(round_deadline_ms=5000, max_wait_ms=5000, startup_timeout_s=60)


@pytest.fixture(scope="module")
def reference(target):
    return {rid: plain_decode(target, p, NEW) for rid, p in PROMPTS.items()}


def drafter_spec(models, name):
    return {"dspark": models["dspark"], "dspark-tokens": models["dspark-tokens"], "lm": "lm",
            "ngram": "ngram", "wrong": "remote_drafter.testing:WrongEveryThird"}[name]


def layers(name):
    return HIDDEN_LAYERS if name == "dspark" else ()


def report_gap(target, result, reference):
    """ARCHITECTURE.md § Exactness: a difference is reported with the target's top-2 logit gap there."""
    for rid, want in reference.items():
        got = result.tokens[rid]
        if got != want:
            i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
            logits, _ = target(torch.tensor(PROMPTS[rid] + want[:i]))
            top = logits[-1].topk(2).values
            return f"request {rid} differs at token {i}: top-2 logit gap {float(top[0] - top[1]):.3g}"
    return None


@pytest.mark.parametrize("name", ["dspark", "dspark-tokens", "lm", "ngram", "wrong"])
def test_local_drafts_change_nothing(models, target, reference, name):
    drafter = WrongEveryThird(models["target"]) if name == "wrong" else \
        load_drafter(drafter_spec(models, name), models["target"])
    client = DrafterClient(LocalTransport(DraftService(drafter)), "8:5")
    result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=layers(name))
    assert report_gap(target, result, reference) is None
    if name == "lm":  # the target's own copy: every draft accepted
        assert result.accepted and all(a == d for a, d in zip(result.accepted, result.drafted))
        assert all(d == 5 for d in result.drafted[:3])
    if name == "wrong":  # rejections happened, at the planted places only
        assert 0 < sum(result.accepted) < sum(result.drafted)
        assert max(result.accepted) <= 2
    assert client.counters()["rounds_failed"] == 0


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("name", ["dspark", "wrong"])
def test_remote_drafts_change_nothing(models, target, reference, backend, name):
    worker = WorkerProcess(drafter_spec(models, name), models["target"], backend)
    try:
        client = DrafterClient(RemoteTransport(worker.address, backend, expectation(models["target"], None)),
                               "8:5", deadline_s=10)
        result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=layers(name))
        assert report_gap(target, result, reference) is None
        counters = client.counters()
        assert counters["rounds_failed"] == 0 and counters["drafts"] > 0
        per_token = client.transport.info(1).described["round_bytes_per_token"]["float32"]
        assert per_token == (4 + 3 * 64 * 4 if name == "dspark" else 4)
        assert counters["request_bytes_per_token"] > 0.5 * per_token
        local = DrafterClient(LocalTransport(DraftService(
            WrongEveryThird(models["target"]) if name == "wrong"
            else load_drafter(drafter_spec(models, name), models["target"]))), "8:5")
        assert speculative_decode(target, local, PROMPTS, NEW, hidden_layers=layers(name)).accepted \
            == result.accepted  # the same drafts, round by round
    finally:
        worker.stop()


@pytest.mark.parametrize("name", ["dspark", "lm"])
def test_async_drafts_through_the_proxy_change_nothing(models, target, reference, name):
    worker = WorkerProcess(drafter_spec(models, name), models["target"])
    try:
        transport = AsyncTransport(worker.address, "tcp", expectation(models["target"], None), SLOW)
        client = DrafterClient(transport, "8:5", deadline_s=10)
        try:
            result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=layers(name),
                                        mode="async")
            assert report_gap(target, result, reference) is None
            counters = client.counters()
            assert counters["rounds_failed"] == 0 and counters["drafts"] > 0
            assert transport.handoff.counters()["rounds_ok"] >= result.steps
        finally:
            client.close()
    finally:
        worker.stop()


def test_an_async_round_larger_than_a_slot_fails_closed(models, target, reference):
    worker = WorkerProcess(models["dspark"], models["target"])
    try:
        small = HandoffConfig(round_deadline_ms=5000, max_wait_ms=5000, startup_timeout_s=60, slot_bytes=2048)
        client = DrafterClient(AsyncTransport(worker.address, "tcp", expectation(models["target"], None), small),
                               "8:5", deadline_s=10)
        try:
            result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=HIDDEN_LAYERS, mode="async")
            assert result.tokens == reference
            counters = client.counters()  # long opens never fit: no drafts for them, said loudly
            assert counters["opens_too_large"] > 0 and counters["rounds_failed"] == 0
        finally:
            client.close()
    finally:
        worker.stop()


def test_opens_beyond_the_message_size_wait_for_later_steps(models, target, reference):
    """Room for the largest open alone: the others open in the following steps, and the
    large one is not starved by the small continues."""
    transport = LocalTransport(DraftService(load_drafter(models["dspark"], models["target"])))
    transport.max_round_bytes = 13000  # opens: ~3.9, ~2.4 and ~12.5 KB (16 rows of 768 B)
    client = DrafterClient(transport, "8:5")
    seen = []
    result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=HIDDEN_LAYERS,
                                on_round=lambda d: seen.append(sorted(d)))
    assert result.tokens == reference
    assert client.counters()["opens_deferred"] > 0 and client.counters()["opens_too_large"] == 0
    assert len(seen[0]) < len(PROMPTS) and set(seen[-1]) == set(PROMPTS)


def test_one_hot_drafts_are_exact_too(models, target, reference):
    client = DrafterClient(LocalTransport(DraftService(load_drafter(models["dspark"], models["target"]))), "8:5")
    result = speculative_decode(target, client, PROMPTS, NEW, hidden_layers=HIDDEN_LAYERS, use_probs=False)
    assert report_gap(target, result, reference) is None


def test_batch_aware_depth(models, target):
    client = DrafterClient(LocalTransport(DraftService(load_drafter("lm", models["target"]))), "1:5,2:3,3:1")
    seen = []
    speculative_decode(target, client, PROMPTS, 8, on_round=lambda d: seen.append(
        (len(client.requests), {len(x.tokens) for x in d.values()})))
    assert seen[0] == (3, {1})
    assert np.all([depths <= {1} for _, depths in seen])
