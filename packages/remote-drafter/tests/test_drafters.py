"""Unit tier: the DSpark drafter (batching, window, Markov head, token-only mode,
checkpoints and identities), the lm and n-gram back ends, the service's validation."""

import copy
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.engine import protocol as P  # noqa: E402
from remote_drafter.engine.history import History  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.llama import LlamaLM, random_llama  # noqa: E402
from remote_drafter.models.ngram import NgramDrafter  # noqa: E402
from remote_drafter.models.registry import load_drafter  # noqa: E402
from remote_drafter.testing import HIDDEN_LAYERS, TINY  # noqa: E402
from remote_drafter.worker.service import DraftService, ServiceConfig  # noqa: E402


def request(drafter, length: int, seed: int, depth: int = 5, temperature: float = 0.0):
    rng = np.random.default_rng(seed)
    h = drafter.new_history()
    rows = rng.standard_normal((length - 1, drafter.feature)).astype(np.float32) if drafter.feature else None
    h.reset(rng.integers(0, drafter.vocab_size, length).astype(np.int32), rows)
    return DraftRequest(h, depth, temperature, seed)


def signature(draft) -> np.ndarray:
    """What a draft's distributions look like (at T = 0 its probs are one-hot)."""
    return np.concatenate([draft.tokens, draft.own_probs, draft.alt_probs])


@pytest.mark.parametrize("name", ["dspark", "dspark-tokens"])
def test_a_request_drafts_the_same_alone_or_batched(models, name):
    """Same tokens at T = 0 (fixed-shape rows: padding never leaks). The bits of the
    probabilities may differ, since BLAS sums differently for another row count: that is
    why the service drafts requests alone when the speculation cache is on."""
    d = load_drafter(models[name], models["target"])
    reqs = [request(d, n, s) for s, n in enumerate([3, 30, 9])]
    batched = d.draft(reqs, want_probs=True)
    for r, b in zip(reqs, batched):
        alone = d.draft([r], want_probs=True)[0]
        assert np.array_equal(alone.tokens, b.tokens) and np.array_equal(alone.probs, b.probs)


def test_context_is_a_sliding_window(models):
    """Rows older than the window change nothing; a row inside it changes the logits."""
    d = load_drafter(models["dspark"], models["target"])
    r = request(d, 40, 3)
    full = d.draft([r], True)[0]
    h = History(4096, 1000, d.feature)  # a history that kept every row, old ones altered
    rows = np.random.default_rng(9).standard_normal((39, d.feature)).astype(np.float32)
    rows[-d.window:] = r.history.rows
    h.reset(r.history.tokens, rows)
    h.rows = h.rows[-d.window:]
    assert np.array_equal(signature(d.draft([DraftRequest(h, 5)], True)[0]), signature(full))
    r2 = copy.deepcopy(r)
    rows = r2.history.rows.copy()  # rows are read-only: a change is an assignment
    rows[-1] += 1.0
    r2.history.rows = rows
    assert not np.array_equal(signature(d.draft([r2], True)[0]), signature(full))
    assert len(r.history.rows) == d.window  # memory per request is bounded by the window


def test_markov_head_corrects_left_to_right(models):
    """Each draft is the argmax of z_i + W2 W1[x_{i-1}], from x_0 = the anchor."""
    d = load_drafter(models["dspark"], models["target"])
    r = request(d, 12, 4)
    got = d.draft([r], True)[0]
    ctx, valid, pos = (torch.from_numpy(a) for a in d._context([r]))
    anchor = int(r.history.tokens[-1])
    with torch.no_grad():
        z = d.model.block_logits(ctx, valid, pos, torch.tensor([anchor]),
                                 torch.tensor([r.history.length - 1]))[0]
        w1, w2 = d.model.markov.w1.weight, d.model.markov.w2.weight
        previous = [anchor] + got.tokens[:-1].tolist()
        for i, x in enumerate(got.tokens):
            p = torch.softmax(z[i] + w2 @ w1[previous[i]], -1)
            assert int(p.argmax()) == x and float(p[x]) == pytest.approx(float(got.own_probs[i]), rel=1e-5)
        assert (w2 @ w1[anchor]).abs().max() > 0.1  # the head is not inert in this model


def test_depth_is_a_prefix(models):
    d = load_drafter(models["dspark"], models["target"])
    r5, r2 = request(d, 10, 5, depth=5), request(d, 10, 5, depth=2)
    assert np.array_equal(d.draft([r5], False)[0].tokens[:2], d.draft([r2], False)[0].tokens)


def test_sampled_drafts_are_seeded_by_position(models):
    d = load_drafter(models["dspark-tokens"], models["target"])
    not_argmax = 0
    for seed in range(10):
        a = d.draft([request(d, 10, seed, temperature=1.5)], True)[0]
        b = d.draft([request(d, 10, seed, temperature=1.5)], True)[0]
        assert np.array_equal(a.tokens, b.tokens) and np.allclose(a.probs.sum(-1), 1.0, atol=1e-5)
        not_argmax += int((a.tokens != a.probs.argmax(-1)).sum())
    assert not_argmax > 0  # drawn, not the argmax


def test_checkpoint_identities(models, tmp_path):
    d = load_drafter(models["dspark"], models["target"])
    m = d.manifest()
    assert m.kind == "dspark" and len({m.target, m.drafter, m.markov}) == 3
    changed = tmp_path / "markov-changed"
    os.makedirs(changed)
    for name in os.listdir(models["dspark"]):
        (changed / name).write_bytes(open(os.path.join(models["dspark"], name), "rb").read())
    from safetensors.torch import load_file, save_file
    state = load_file(str(changed / "drafter.safetensors"))
    state["markov.w1.weight"] = state["markov.w1.weight"] + 1
    save_file(state, str(changed / "drafter.safetensors"))
    m2 = load_drafter(str(changed), models["target"]).manifest()
    assert (m2.target, m2.drafter) == (m.target, m.drafter) and m2.markov != m.markov
    assert m2.fingerprint != m.fingerprint


def test_a_drafter_refuses_another_target(models, tmp_path):
    random_llama(TINY, seed=5).save(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="was built for target"):
        load_drafter(models["dspark"], str(tmp_path / "other"))
    with pytest.raises(ValueError, match="pass the target"):
        load_drafter(models["dspark"], None)


def test_target_loads_what_it_saved(models):
    t = LlamaLM.load(models["target"])
    with open(os.path.join(models["target"], "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
    logits, hidden = t(torch.tensor([1, 2, 3]), HIDDEN_LAYERS)
    assert logits.shape == (3, TINY.vocab_size) and hidden.shape == (3, 3 * TINY.hidden_size)
    # causal: a later token never changes an earlier position's output
    logits2, _ = t(torch.tensor([1, 2, 3, 4]))
    assert torch.allclose(logits, logits2[:3], atol=1e-5)


def test_ngram_proposes_what_followed_the_newest_match():
    d = NgramDrafter(vocab_size=50, min_n=2, max_n=3)
    tokens = np.array([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3], np.int32)
    assert d.lookup(tokens, 3).tolist() == [7, 8, 1]
    assert d.lookup(np.array([1, 2, 3, 4], np.int32), 3).tolist() == []


def test_service_refuses_bad_entries_and_keeps_serving(models):
    d = load_drafter(models["dspark"], models["target"])
    svc = DraftService(d, ServiceConfig(max_requests=2))
    fp, f = d.manifest().fingerprint, d.feature
    rows = np.zeros((3, f), np.float32)
    good = P.Entry(1, P.OP_OPEN, np.array([1, 2, 3, 4], np.int32), rows, 3, length=4)
    bad = [P.Entry(2, P.OP_OPEN, np.array([1, 2, 500], np.int32), rows[:2], 3, length=3),  # id range
           P.Entry(3, P.OP_OPEN, np.array([1, 2, 3], np.int32), rows[:1], 3, length=3),    # rows
           P.Entry(4, P.OP_OPEN, np.array([1, 2], np.int32), rows[:1], 99, length=2),       # depth
           P.Entry(5, P.OP_CONTINUE, np.array([1], np.int32), rows[:1], 3),                 # unknown
           P.Entry(7, P.OP_OPEN, np.array([1, 2], np.int32), np.full((1, f), np.nan, np.float32), 3, length=2)]
    replies = P.parse_reply(svc.handle(P.encode_request([good, *bad], fp)))
    assert replies[0].ok and len(replies[0].tokens) == 3
    assert [r.status for r in replies[1:]] == [P.STATUS_INVALID] * 3 + [P.STATUS_UNKNOWN, P.STATUS_INVALID]
    assert "outside" in replies[1].message and "hidden rows" in replies[2].message and "NaN" in replies[5].message
    narrow = P.Entry(6, P.OP_OPEN, np.array([1, 2], np.int32), np.zeros((1, 7), np.float32), 3, length=2)
    replies = P.parse_reply(svc.handle(P.encode_request([narrow], fp)))
    assert replies[0].status == P.STATUS_INVALID and "width 7" in replies[0].message
    full = [P.Entry(i, P.OP_OPEN, np.array([1, 2], np.int32), rows[:1], 1, length=2) for i in (10, 11)]
    replies = P.parse_reply(svc.handle(P.encode_request(full, fp)))
    assert [r.status for r in replies] == [P.STATUS_OK, P.STATUS_CAPACITY] and "worker full" in replies[1].message
    huge = P.Entry(12, P.OP_OPEN, np.array([1, 2], np.int32), rows[:1], 1, length=2**64 - 1)
    assert P.parse_reply(svc.handle(P.encode_request([huge], fp)))[0].status == P.STATUS_INVALID
    stats = svc.stats()
    assert stats["invalid_entries"] == 6 and stats["unknown_requests"] == 1 and stats["capacity_refusals"] == 1
    with pytest.raises(P.ProtocolError, match="identity mismatch"):
        svc.handle(P.encode_request([good], bytes(16)))
    assert svc.stats()["rounds_refused"] == 1


def test_a_request_that_breaks_the_drafter_fails_alone(models):
    class Fragile(NgramDrafter):
        def draft(self, requests, want_probs):
            if any(r.history.tokens[-1] == 77 for r in requests):
                raise RuntimeError("cannot draft after 77")
            return super().draft(requests, want_probs)
    d = Fragile(vocab_size=96)
    svc = DraftService(d)
    entries = [P.Entry(i, P.OP_OPEN, np.array([5, 6, 5, last], np.int32), None, 2, length=4)
               for i, last in ((1, 6), (2, 77), (3, 6))]
    replies = P.parse_reply(svc.handle(P.encode_request(entries, d.manifest().fingerprint)))
    assert [r.status for r in replies] == [P.STATUS_OK, P.STATUS_INVALID, P.STATUS_OK]
    assert "cannot draft after 77" in replies[1].message and len(replies[0].tokens) > 0


def test_idle_requests_are_released(models):
    d = load_drafter("ngram", models["target"])
    svc = DraftService(d, ServiceConfig(idle_timeout_s=0.0))
    fp = d.manifest().fingerprint
    svc.handle(P.encode_request([P.Entry(1, P.OP_OPEN, np.array([1, 2], np.int32), None, 0, length=2)], fp))
    svc.expire_idle()
    assert svc.stats()["open_requests"] == 0 and svc.stats()["idle_releases"] == 1


def test_committed_tokens_count_what_the_histories_took(models):
    """The worker counts, once a round, the tokens of the entries its histories took: opens,
    continues (drafted or just recorded); not releases, refusals or unknown requests."""
    d = load_drafter("ngram", models["target"])
    svc = DraftService(d)
    fp = d.manifest().fingerprint

    def round_(*entries):
        return P.parse_reply(svc.handle(P.encode_request(list(entries), fp)))

    round_(P.Entry(1, P.OP_OPEN, np.array([1, 2, 3], np.int32), None, 2, length=3),
           P.Entry(2, P.OP_OPEN, np.array([4, 5], np.int32), None, 0, length=2))
    assert svc.stats()["committed_tokens"] == 5
    replies = round_(P.Entry(1, P.OP_CONTINUE, np.array([7], np.int32), None, 0, length=4),  # recorded
                     P.Entry(2, P.OP_CONTINUE, np.array([8, 9], np.int32), None, 2, length=4),  # drafted
                     P.Entry(3, P.OP_CONTINUE, np.array([1], np.int32), None, 2, length=9),  # unknown
                     P.Entry(4, P.OP_OPEN, np.array([d.vocab_size], np.int32), None, 2, length=1))  # invalid id
    assert [r.status for r in replies] == [P.STATUS_OK, P.STATUS_OK, P.STATUS_UNKNOWN, P.STATUS_INVALID]
    assert svc.stats()["committed_tokens"] == 5 + 3
    round_(P.Entry(1, P.OP_RELEASE))
    assert svc.stats()["committed_tokens"] == 8


def test_rounds_look_for_idle_requests_only_once_one_may_have_timed_out(models, monkeypatch):
    """A round looks for idle requests (a pass over every request held) only once the least
    recently used request's timeout has passed, so every request still goes at the first
    round after its timeout, and its slot serves an open at once."""
    from remote_drafter.worker import service as service_module
    now = [1000.0]
    monkeypatch.setattr(service_module.time, "monotonic", lambda: now[0])
    d = load_drafter("ngram", models["target"])
    svc = DraftService(d, ServiceConfig(idle_timeout_s=100.0, max_requests=11))
    fp, looks, expire = d.manifest().fingerprint, [], svc._expire_idle
    monkeypatch.setattr(svc, "_expire_idle", lambda: looks.append(now[0]) or expire())

    def open_request(rid):
        [reply] = P.parse_reply(svc.handle(P.encode_request(
            [P.Entry(rid, P.OP_OPEN, np.array([1, 2], np.int32), None, 0, length=2)], fp)))
        return reply.status

    assert open_request(1) == P.STATUS_OK
    for rid in range(2, 12):
        now[0] += 1.0
        assert open_request(rid) == P.STATUS_OK
    assert looks == [1000.0]  # the first round's; no request held could time out since
    now[0] = 1100.5  # request 1 (last used at 1000) idle past its timeout, the others not
    assert open_request(12) == P.STATUS_OK  # the worker is full: request 1's slot serves it
    assert looks[1:] == [now[0]] and svc.stats()["idle_releases"] == 1
    assert open_request(13) == P.STATUS_CAPACITY  # request 2 times out at 1101, not before
    now[0] = 1101.5
    assert open_request(13) == P.STATUS_OK and svc.stats()["idle_releases"] == 2


def test_the_cache_refuses_a_hidden_state_drafter(models):
    with pytest.raises(ValueError, match="tokens alone"):
        DraftService(load_drafter(models["dspark"], models["target"]), ServiceConfig(spec_cache=True))
