"""Unit tier: the engine-side client (depth table, request bookkeeping, reply validation)
and that the modules the engine and the proxy load are torch-free."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from remote_drafter import protocol as P
from remote_drafter.client import DepthTable, DrafterClient, as_rows
from remote_drafter.drafters import load_drafter
from remote_drafter.service import DraftService
from remote_drafter.transport import LocalTransport


def test_depth_table():
    t = DepthTable("1:5,8:4,16:3,32:0")
    assert [t.depth(r) for r in (1, 2, 8, 9, 16, 17, 32, 33)] == [5, 4, 4, 3, 3, 0, 0, 0]
    for bad in ("", "5", "1:x", "1:-1"):
        with pytest.raises(ValueError, match="depth table"):
            DepthTable(bad)


def test_rows_from_tensors_of_any_dtype():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert as_rows(t).dtype == np.float32 and as_rows(t).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert as_rows(None) is None and as_rows(np.zeros((2, 1, 4))).shape == (2, 4)


class Recording:
    """A transport that records requests and answers with a canned reply."""

    max_round_bytes = 1 << 30

    def __init__(self, inner, reply=None):
        self.inner, self.reply, self.sent = inner, reply, []

    def info(self, deadline_s):
        return self.inner.info(deadline_s)

    def call(self, payload, deadline_s):
        self.sent.append(P.parse_request(payload, None).entries)
        return self.reply(payload) if self.reply else self.inner.call(payload, deadline_s)

    def invalidate(self):
        pass

    def close(self):
        pass


def test_a_reused_id_is_opened_not_released(models):
    rec = Recording(LocalTransport(DraftService(load_drafter("ngram", models["target"]))))
    client = DrafterClient(rec, "8:3")
    client.add_request(1, [1, 2, 3, 1, 2])
    client.propose()
    client.release(1)
    client.add_request(1, [4, 5, 4])  # the engine reuses the id before the next round
    assert client.counters()["rounds_failed"] == 0
    client.propose()
    assert [(e.request_id, e.op) for e in rec.sent[-1]] == [(1, P.OP_OPEN)]
    assert client.counters()["rounds_failed"] == 0


def test_a_long_silence_reopens_instead_of_queueing(models):
    rec = Recording(LocalTransport(DraftService(load_drafter("ngram", models["target"], history_tokens=16))))
    client = DrafterClient(rec, "8:0", history_tokens=16)
    client.add_request(1, [1, 2])
    client.propose(k=1)
    for _ in range(20):  # depth 0 (large batch): no rounds, tokens pile up past the bound
        client.commit(1, [3])
    assert not client.requests[1].pending_tokens and client.requests[1].needs_open
    client.propose(k=1)
    e = rec.sent[-1][0]
    assert e.op == P.OP_OPEN and len(e.tokens) == 16 and e.length == 22


@pytest.mark.parametrize("reply, why", [
    (lambda p: b"junk", "ProtocolError"),
    (lambda p: P.encode_reply([P.Reply(1, tokens=np.array([10_000], np.int32))], 96), "invalid drafts"),
    (lambda p: P.encode_reply([P.Reply(2, tokens=np.array([1], np.int32))], 96), "do not match"),
    (lambda p: P.encode_reply([P.Reply(1, tokens=np.arange(9, dtype=np.int32))], 96), "invalid drafts"),
])
def test_bad_replies_fail_closed(models, reply, why, caplog):
    rec = Recording(LocalTransport(DraftService(load_drafter("ngram", models["target"]))), reply)
    client = DrafterClient(rec, "8:3")
    client.add_request(1, [1, 2, 3, 1, 2])
    assert client.propose() == {}
    assert client.counters()["rounds_failed"] == 1 and client.requests[1].needs_open
    assert why in caplog.text


def test_engine_and_proxy_modules_import_without_torch():
    """The client, transports and the proxy adapter never import torch."""
    code = ("import sys; import remote_drafter.client, remote_drafter.transport, remote_drafter.adapter, "
            "remote_drafter.factory, remote_drafter.protocol, remote_drafter.identity; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_seed_or_temperature_from_the_engine():
    client = DrafterClient(Recording(None), "8:3")
    client.add_request(1, [1, 2], seed=-5)  # masked to 64 bits, never an OverflowError later
    assert client.requests[1].seed == 2**64 - 5
    with pytest.raises(ValueError, match="temperature"):
        client.add_request(2, [1, 2], temperature=float("nan"))


def test_probabilities_that_would_overflow_the_reply_are_skipped_not_failed(models, target):
    from remote_drafter.reference import plain_decode, speculative_decode
    transport = LocalTransport(DraftService(load_drafter("lm", models["target"])))
    transport.max_round_bytes = 6000  # room for two replies with 5 x 96 probabilities
    client = DrafterClient(transport, "8:5", want_probs=True)
    prompts = {1: [1, 2, 3], 2: [4, 5, 6], 3: [7, 8, 9]}
    result = speculative_decode(target, client, prompts, 12)
    assert result.tokens == {r: plain_decode(target, p, 12) for r, p in prompts.items()}
    c = client.counters()
    assert c["drafts_skipped_reply_size"] > 0 and c["rounds_failed"] == 0 and c["drafts"] > 0


def test_the_client_keeps_what_the_worker_looks_at(models, target):
    """A client configured with a smaller window than the worker's adopts the worker's,
    so opens carry the rows the worker needs."""
    from remote_drafter.reference import plain_decode, speculative_decode
    client = DrafterClient(LocalTransport(DraftService(load_drafter(models["dspark"], models["target"]))),
                           "8:5", window=4)
    prompts = {1: list(range(1, 30))}
    result = speculative_decode(target, client, prompts, 10, hidden_layers=(0, 2, 3))
    assert result.tokens[1] == plain_decode(target, prompts[1], 10)
    assert client.window == 16 and client.counters()["entries_failed"] == 0


def test_a_failed_round_keeps_its_releases_and_every_request_reopens(models):
    def broken(payload):
        raise ConnectionError("link down")
    rec = Recording(LocalTransport(DraftService(load_drafter("ngram", models["target"]))), broken)
    client = DrafterClient(rec, "8:3")
    client.add_request(1, [1, 2, 3])
    client.add_request(2, [4, 5, 6])
    client.release(1)
    assert client.propose() == {}
    assert client.releases == [1] and client.requests[2].needs_open


def test_submit_never_raises(models):
    class Exploding(Recording):
        def submit(self, payload):
            raise RuntimeError("proxy exploded")
    client = DrafterClient(Exploding(LocalTransport(DraftService(load_drafter("ngram", models["target"])))), "8:3")
    client.add_request(1, [1, 2, 3])
    client.propose()
    client.commit(1, [4])
    assert client.submit() is False and client.collect() == {}
    assert client.counters()["rounds_failed"] == 1 and client.requests[1].needs_open


def test_invalid_probabilities_are_refused(models, caplog):
    def nan_probs(payload):
        return P.encode_reply([P.Reply(1, tokens=np.array([3], np.int32),
                                       probs=np.full((1, 96), np.nan, np.float32))], 96)
    client = DrafterClient(Recording(LocalTransport(DraftService(load_drafter("ngram", models["target"]))),
                                     nan_probs), "8:3", want_probs=True)
    client.add_request(1, [1, 2, 3, 1, 2])
    assert client.propose() == {} and "invalid probabilities" in caplog.text


def test_clients_sharing_a_worker_keep_their_own_requests(models):
    """Two engines both use request id 1: each has its own state on the worker, and a
    continue whose count disagrees with the worker's is answered 'unknown' (re-open)."""
    d = load_drafter("ngram", models["target"])
    svc, fp = DraftService(d), d.manifest().fingerprint

    def send(client_id, *entries):
        return P.parse_reply(svc.handle(P.encode_request(list(entries), fp, client_id=client_id)))

    send(1, P.Entry(1, P.OP_OPEN, np.array([1, 2, 3], np.int32), None, 0, length=3))
    send(2, P.Entry(1, P.OP_OPEN, np.array([7, 8], np.int32), None, 0, length=2))
    assert send(1, P.Entry(1, P.OP_CONTINUE, np.array([4], np.int32), None, 2, length=4))[0].ok
    assert send(2, P.Entry(1, P.OP_CONTINUE, np.array([9], np.int32), None, 2, length=3))[0].ok
    assert svc.stats()["open_requests"] == 2
    drift = send(1, P.Entry(1, P.OP_CONTINUE, np.array([5], np.int32), None, 2, length=9))[0]
    assert drift.status == P.STATUS_UNKNOWN and "out of step" in drift.message
    assert svc.stats()["out_of_step"] == 1 and svc.stats()["open_requests"] == 1


def test_continues_left_out_of_a_full_round_stay_continues(models):
    """Rounds with room for three opens and two continues: the opens spread over steps, and
    a continue left out waits as a continue (not a window-sized re-open, which would keep
    the round full of re-opens and never draft every request in one step)."""
    drafter = load_drafter(models["dspark"], models["target"])
    transport = LocalTransport(DraftService(drafter))
    f, n, rng = drafter.feature, 8, np.random.default_rng(0)
    tokens, rows = np.zeros(40, np.int32), np.zeros((drafter.window, f), np.float32)
    opened = P.entry_bytes(P.Entry(0, P.OP_OPEN, tokens, rows), "float32")
    continued = P.entry_bytes(P.Entry(0, P.OP_CONTINUE, tokens[:1], rows[:1]), "float32")
    transport.max_round_bytes = P.REQUEST_HEADER.itemsize + 3 * opened + 2 * continued
    client = DrafterClient(transport, "64:5")
    for rid in range(n):
        client.add_request(rid, rng.integers(0, drafter.vocab_size - 1, 40),
                           rng.standard_normal((39, f)).astype(np.float32))
    drafted = []
    for _ in range(12):
        drafted.append(len(client.propose()))
        for rid in range(n):
            client.commit(rid, [int(rng.integers(0, drafter.vocab_size - 1))],
                          rng.standard_normal((1, f)).astype(np.float32))
    assert drafted[0] < n and drafted[-4:] == [n] * 4, drafted
    assert client.counters()["opens_too_large"] == 0
