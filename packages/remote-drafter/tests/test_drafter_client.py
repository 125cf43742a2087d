"""Unit tier (torch-free): the engine-side client (depth table, request bookkeeping, reply
validation) against the n-gram drafter in local mode."""

import numpy as np
import pytest

from remote_drafter.engine import protocol as P
from remote_drafter.engine.client import DepthTable, DrafterClient
from remote_drafter.engine.rows import as_rows
from remote_drafter.engine.transport import LocalTransport
from remote_drafter.models.ngram import NgramDrafter
from remote_drafter.worker.service import DraftService

VOCAB = 96


def ngram(**options) -> LocalTransport:
    return LocalTransport(DraftService(NgramDrafter(vocab_size=VOCAB, **options)))


def test_depth_table():
    t = DepthTable("1:5,8:4,16:3,32:0")
    assert [t.depth(r) for r in (1, 2, 8, 9, 16, 17, 32, 33)] == [5, 4, 4, 3, 3, 0, 0, 0]
    for bad in ("", "5", "1:x", "1:-1"):
        with pytest.raises(ValueError, match="depth table"):
            DepthTable(bad)


class Recording:
    """A transport that records requests and answers with a canned reply."""

    max_round_bytes = 1 << 30

    def __init__(self, inner, reply=None):
        self.inner, self.reply, self.sent = inner, reply, []

    def info(self, deadline_s):
        return self.inner.info(deadline_s)

    def call(self, parts, deadline_s):
        payload = b"".join(parts)
        self.sent.append(P.parse_request(payload, None).entries)
        return self.reply(payload) if self.reply else self.inner.call(parts, deadline_s)

    def invalidate(self):
        pass

    def close(self):
        pass


def test_a_reused_id_is_opened_not_released():
    rec = Recording(ngram())
    client = DrafterClient(rec, "8:3")
    client.add_request(1, [1, 2, 3, 1, 2])
    client.propose()
    client.release(1)
    client.add_request(1, [4, 5, 4])  # the engine reuses the id before the next round
    assert client.counters()["rounds_failed"] == 0
    client.propose()
    assert [(e.request_id, e.op) for e in rec.sent[-1]] == [(1, P.OP_OPEN)]
    assert client.counters()["rounds_failed"] == 0


def test_a_long_silence_reopens_instead_of_queueing():
    rec = Recording(ngram(history_tokens=16))
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
    (lambda p: P.encode_reply([P.Reply(1, tokens=np.array([10_000], np.int32))], VOCAB), "invalid drafts"),
    (lambda p: P.encode_reply([P.Reply(2, tokens=np.array([1], np.int32))], VOCAB), "do not match"),
    (lambda p: P.encode_reply([P.Reply(1, tokens=np.arange(9, dtype=np.int32))], VOCAB), "invalid drafts"),
])
def test_bad_replies_fail_closed(reply, why, caplog):
    rec = Recording(ngram(), reply)
    client = DrafterClient(rec, "8:3")
    client.add_request(1, [1, 2, 3, 1, 2])
    assert client.propose() == {}
    assert client.counters()["rounds_failed"] == 1 and client.requests[1].needs_open
    assert why in caplog.text


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_one_bad_draft_among_a_rounds_entries_fails_the_round_and_is_named(bad, caplog):
    """The round's drafts are checked in one pass; the entry that fails it is named."""
    def reply(p):
        return P.encode_reply([P.Reply(1, tokens=np.array([1, 2], np.int32)),
                               P.Reply(2, tokens=np.array([3, bad], np.int32))], VOCAB)
    client = DrafterClient(Recording(ngram(), reply), "8:3")
    client.add_request(1, [1, 2, 3, 1, 2])
    client.add_request(2, [1, 2, 3, 1, 2])
    assert client.propose() == {}
    assert client.counters()["rounds_failed"] == 1
    assert "reply for request 2 carries invalid drafts" in caplog.text


def test_bad_seed_or_temperature_from_the_engine():
    client = DrafterClient(Recording(None), "8:3")
    client.add_request(1, [1, 2], seed=-5)  # masked to 64 bits, never an OverflowError later
    assert client.requests[1].seed == 2**64 - 5
    with pytest.raises(ValueError, match="temperature"):
        client.add_request(2, [1, 2], temperature=float("nan"))


def test_a_failed_round_keeps_its_releases_and_every_request_reopens():
    def broken(payload):
        raise ConnectionError("link down")
    rec = Recording(ngram(), broken)
    client = DrafterClient(rec, "8:3")
    client.add_request(1, [1, 2, 3])
    client.add_request(2, [4, 5, 6])
    client.release(1)
    assert client.propose() == {}
    assert client.releases == [1] and client.requests[2].needs_open


def test_submit_never_raises():
    class Exploding(Recording):
        def submit(self, payload):
            raise RuntimeError("proxy exploded")
    client = DrafterClient(Exploding(ngram()), "8:3")
    client.add_request(1, [1, 2, 3])
    client.propose()
    client.commit(1, [4])
    assert client.submit() is False and client.collect() == {}
    assert client.counters()["rounds_failed"] == 1 and client.requests[1].needs_open


def test_invalid_probabilities_are_refused(caplog):
    def nan_probs(payload):
        return P.encode_reply([P.Reply(1, tokens=np.array([3], np.int32),
                                       probs=np.full((1, VOCAB), np.nan, np.float32))], VOCAB)
    client = DrafterClient(Recording(ngram(),
                                     nan_probs), "8:3", want_probs=True)
    client.add_request(1, [1, 2, 3, 1, 2])
    assert client.propose() == {} and "invalid probabilities" in caplog.text


def test_clients_sharing_a_worker_keep_their_own_requests():
    """Two engines both use request id 1: each has its own state on the worker, and a
    continue whose count disagrees with the worker's is answered 'unknown' (re-open)."""
    d = NgramDrafter(vocab_size=VOCAB)
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


def test_rows_are_float32_two_dimensional():
    assert as_rows(None) is None and as_rows(np.zeros((2, 1, 4))).shape == (2, 4)
    assert as_rows([[1, 2], [3, 4]]).dtype == np.float32
