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
        self.sent.append(P.parse_request(payload, None)[1])
        return self.reply(payload) if self.reply else self.inner.call(payload, deadline_s)

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
    rec = Recording(LocalTransport(DraftService(load_drafter("ngram", models["target"]))))
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
