"""Unit tier (torch-free): the wire format round-trips, and every malformed message is refused."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_drafter.engine import protocol as P
from remote_drafter.engine.rows import BFLOAT16, DTYPES, cast

FP = bytes(range(16))


def entries():
    rows = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    return [P.Entry(7, P.OP_OPEN, np.array([1, 2, 3, 4], np.int32), rows, 5, 0.7, 99, True, length=40),
            P.Entry(8, P.OP_CONTINUE, np.array([5], np.int32), rows[:1], 3),
            P.Entry(9, P.OP_RELEASE)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_request_round_trip(dtype):
    sent = entries()
    request = P.parse_request(P.encode_request(sent, FP, dtype, client_id=42), FP)
    got = request.entries
    assert request.kind == P.KIND_ROUND and request.client_id == 42 and [e.request_id for e in got] == [7, 8, 9]
    a, b = sent[0], got[0]
    assert (b.op, b.k, b.seed, b.want_probs, b.length, b.feature) == (P.OP_OPEN, 5, 99, True, 40, 8)
    assert b.temperature == pytest.approx(0.7) and np.array_equal(a.tokens, b.tokens)
    assert b.rows.dtype == DTYPES[dtype]  # as sent: the worker's history keeps that type
    np.testing.assert_array_equal(b.rows.astype(np.float32), a.rows.astype(DTYPES[dtype]).astype(np.float32))
    assert got[2].rows is None and got[2].op == P.OP_RELEASE


def test_bf16_rows_go_as_they_are():
    """Rows already bf16 (a bf16 engine's) are sent without a conversion: the same bits."""
    mine = cast(np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32), BFLOAT16)
    got = P.parse_request(P.encode_request([P.Entry(1, P.OP_OPEN, np.arange(3, dtype=np.int32), mine, 1)],
                                           FP, "bfloat16"), FP).entries[0]
    assert got.rows.view(np.uint16).tobytes() == mine.view(np.uint16).tobytes()


def test_reply_round_trip():
    probs = np.full((2, 5), 0.2, np.float32)
    sent = [P.Reply(7, P.STATUS_OK, np.array([1, 2], np.int32), probs, P.CACHE_HIT, 123),
            P.Reply(8, P.STATUS_CAPACITY, message="worker full")]
    got = P.parse_reply(P.encode_reply(sent, 5))
    assert got[0].ok and got[0].cache == P.CACHE_HIT and np.array_equal(got[0].probs, probs)
    assert got[1].status == P.STATUS_CAPACITY and got[1].message == "worker full"


@pytest.mark.parametrize("mutate, why", [
    (lambda b: b[:10], "shorter than its header"),
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + (9).to_bytes(2, "little") + b[6:], "version mismatch"),
    (lambda b: b[:8] + bytes(16) + b[24:], "identity mismatch"),
    (lambda b: b[:P.REQUEST_HEADER.itemsize + P.ENTRY.itemsize + 7], "truncated within them"),
    (lambda b: b[:-3], "announced"),
    (lambda b: b + b"\0", "trailing"),
    (lambda b: b[:36] + bytes([9]) + b[37:], "unknown row dtype code 9"),
    (lambda b: b[:32] + (1 << 30).to_bytes(4, "little") + b[36:], "rows of 1073741824 x 4 bytes"),
])
def test_malformed_requests_are_refused(mutate, why):
    with pytest.raises(P.ProtocolError, match=why):
        P.parse_request(mutate(P.encode_request(entries(), FP)), FP)


def test_a_request_is_one_table_then_every_tokens_then_every_rows():
    """The layout the worker checks in one pass per block: the tokens of all entries, then
    the rows of all entries, each in entry order."""
    sent = entries()
    buf = P.encode_request(sent, FP, "float32")
    request = P.parse_request(buf, FP)
    np.testing.assert_array_equal(request.tokens, np.concatenate([e.tokens for e in sent]))
    np.testing.assert_array_equal(request.rows, np.concatenate([e.rows for e in sent if e.rows is not None]))
    table = P.REQUEST_HEADER.itemsize + len(sent) * P.ENTRY.itemsize
    assert bytes(buf[table:table + 4 * 5]) == request.tokens.tobytes()
    assert request.entries[1].rows.base is not None  # a view of the message, not a copy
    with pytest.raises(ValueError, match="one width"):
        P.encode_request([sent[0], P.Entry(8, P.OP_CONTINUE, np.array([5], np.int32), np.zeros((1, 4), np.float32))], FP)


@pytest.mark.parametrize("mutate, why", [
    (lambda b: b[:20], "truncated within them"),
    (lambda b: b[:-1], "announced"),
    (lambda b: b + b"\0", "announced"),
    (lambda b: b[:30] + bytes([6]) + b[31:], "unknown status 6"),
])
def test_malformed_replies_are_refused(mutate, why):
    sent = [P.Reply(7, P.STATUS_OK, np.array([1, 2], np.int32), np.full((2, 5), 0.2, np.float32)),
            P.Reply(8, P.STATUS_CAPACITY, message="worker full")]
    with pytest.raises(P.ProtocolError, match=why):
        P.parse_reply(mutate(P.encode_reply(sent, 5)))


def test_duplicate_request_ids_are_refused():
    e = entries()[1]
    with pytest.raises(P.ProtocolError, match="twice"):
        P.parse_request(P.encode_request([e, e], FP), FP)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 400))
def test_fuzzed_requests_parse_or_raise_protocol_error(noise, cut):
    """Random bytes, or a valid message cut and spliced with random bytes: never anything
    but a clean parse or ProtocolError (no IndexError, no giant allocation)."""
    valid = P.encode_request(entries(), FP)
    for buf in (noise, valid[:cut] + noise, valid[:32] + noise):
        try:
            P.parse_request(buf, FP)
        except P.ProtocolError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzzed_replies_parse_or_raise_protocol_error(noise):
    valid = P.encode_reply([P.Reply(1, tokens=np.array([3], np.int32))], 4)
    for buf in (noise, valid[:16] + noise):
        try:
            P.parse_reply(buf)
        except P.ProtocolError:
            pass


def test_stats_replies_are_read_within_ofl_json_limits():
    """Stats come from the wire: read by ofl.wire.decode_json (size and depth bounded, a
    ProtocolError where json.loads would raise RecursionError or build anything it is sent)."""
    head = P.encode_stats_reply({})[:P.REPLY_HEADER.itemsize]
    assert P.parse_stats_reply(P.encode_stats_reply({"quota_refusals": 3})) == {"quota_refusals": 3}
    for body, why in [(b"[" * 100_000 + b"]" * 100_000, "nested"), (b" " * (2 << 20), "exceed"),
                      (b"[1, 2]", "expected a JSON object"), (b"\xff", "not JSON")]:
        with pytest.raises(P.ProtocolError, match=why):
            P.parse_stats_reply(head + body)


def test_ids_in_vocab_bounds_both_ends():
    assert P.ids_in_vocab(np.array([0, 5, 9], np.int32), 10) and P.ids_in_vocab(np.zeros(0, np.int32), 10)
    assert not P.ids_in_vocab(np.array([0, 10], np.int32), 10)
    assert not P.ids_in_vocab(np.array([3, -1], np.int32), 10)  # a negative id, not a large valid one
    assert not P.ids_in_vocab(np.array([np.iinfo(np.int32).min], np.int32), 1 << 31)
