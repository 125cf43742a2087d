"""Unit tier: frame headers, read-request codec, range checks; fuzzed with hypothesis."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ofl import wire
from ofl.errors import ProtocolError, VersionMismatch


def test_header_round_trip():
    raw = wire.pack_header(wire.Kind.READ, 77, 1234)
    assert len(raw) == wire.HEADER_SIZE == 24
    h = wire.unpack_header(raw, 1 << 20)
    assert (h.kind, h.request_id, h.length) == (wire.Kind.READ, 77, 1234)


@pytest.mark.parametrize("mutate, error, text", [
    (lambda b: b"XXXX" + b[4:], ProtocolError, "bad magic"),
    (lambda b: b[:4] + (9).to_bytes(2, "little") + b[6:], VersionMismatch, "version mismatch"),
    (lambda b: b[:6] + (99).to_bytes(2, "little") + b[8:], ProtocolError, "unknown frame kind"),
    (lambda b: b[:16] + (1 << 30).to_bytes(8, "little"), ProtocolError, "exceeds the limit"),
    (lambda b: b[:10], ProtocolError, "truncated header"),
])
def test_header_rejects(mutate, error, text):
    raw = mutate(wire.pack_header(wire.Kind.MESSAGE, 1, 10))
    with pytest.raises(error, match=text):
        wire.unpack_header(raw, 1 << 20)


@given(st.binary(min_size=24, max_size=24))
def test_header_fuzz_only_protocol_errors(raw):
    try:
        h = wire.unpack_header(raw, 1 << 20)
    except ProtocolError:
        return
    assert h.length <= 1 << 20


@given(offsets=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=50),
       row=st.integers(0, 2**32 - 1), variable=st.booleans(), data=st.data())
def test_read_request_round_trip(offsets, row, variable, data):
    offs = np.array(offsets, np.uint64)
    lengths = (np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(offsets),
                                           max_size=len(offsets))), np.uint32)
               if variable else max(row, 1))
    req = wire.ReadRequest(3, offs, lengths)
    back = wire.ReadRequest.decode(b"".join(bytes(p) for p in req.encode()))
    assert back.region == 3 and np.array_equal(back.offsets, offs)
    if variable:
        assert np.array_equal(back.lengths, lengths)
    else:
        assert back.lengths == lengths


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_read_request_fuzz_only_protocol_errors(payload):
    try:
        req = wire.ReadRequest.decode(payload)
    except ProtocolError:
        return
    assert 1 <= len(req.offsets) <= wire.MAX_GATHER_ROWS


def test_read_request_limits():
    with pytest.raises(ProtocolError, match="ranges"):
        wire.ReadRequest.decode(wire.READ_HEAD.pack(0, 0, 8))
    with pytest.raises(ProtocolError, match="ranges"):
        wire.ReadRequest.decode(wire.READ_HEAD.pack(0, wire.MAX_GATHER_ROWS + 1, 8))
    with pytest.raises(ProtocolError, match="expected"):
        wire.ReadRequest.decode(wire.READ_HEAD.pack(0, 2, 8) + b"\0" * 8)


@given(size=st.integers(0, 2**40), offsets=st.lists(st.integers(0, 2**64 - 1), max_size=20),
       length=st.integers(0, 2**32 - 1))
def test_check_ranges_matches_python(size, offsets, length):
    offs = np.array(offsets, np.uint64)
    inside = all(o + length <= size for o in offsets)
    assert (wire.check_ranges(offs, length, size) is None) == inside


def test_check_ranges_no_wraparound():
    # offset + length wraps past 2**64 in unsigned arithmetic: must still be refused.
    offs = np.array([2**64 - 8], np.uint64)
    assert wire.check_ranges(offs, 16, 1 << 20) is not None
    assert wire.check_ranges(np.array([0], np.uint64), np.array([2**32 - 1], np.uint32), 100)
