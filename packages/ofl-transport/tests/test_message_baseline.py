"""ofl.bench's message baseline (a plain socket to a process of its own) and the comparison
with ofl's messages: both answer with the reply size asked for, at any request size. CPU,
loopback."""

from ofl import bench


def test_the_plain_socket_baseline_round_trips_the_sizes_asked_for():
    small = bench.raw_message_round_trip(5000, 300, rounds=5)
    assert small["request_bytes"] == 5000 and small["reply_bytes"] == 300 and small["rounds"] == 5
    assert 0 < small["p50_ms"] <= small["p99_ms"]
    raw = bench.RawMessages()
    try:  # larger than the buffers either side starts with: both grow
        raw.request([bytes(3 << 20)], 2 << 20)
        assert len(raw.reply) == 2 << 20
    finally:
        raw.close()


def test_ofl_messages_against_the_plain_socket():
    out = bench.bench_messages([16 << 10, 2 << 20], repeats=3)
    assert list(out) == [str(16 << 10), str(2 << 20)]
    for m in out.values():
        assert m["ofl_p50_ms"] > 0 and m["raw_socket_p50_ms"] > 0
        assert m["ratio"] == m["ofl_p50_ms"] / m["raw_socket_p50_ms"]


def test_a_large_payload_lands_in_the_last_ones_buffer_only_when_nothing_holds_it():
    """The receive side reuses its last large buffer: never one a handler kept (a view, the
    payload itself), never for a small message."""
    import numpy as np

    from ofl import Connection, Server

    kept, seen = [], []

    def handler(payload, peer):
        seen.append(id(payload))
        if payload[0] == 1:
            kept.append(np.frombuffer(payload, np.uint8))  # a view: holds the buffer
        return bytes([payload[0], payload[-1]])

    with Server("tcp", "127.0.0.1", 0, handler=handler) as srv:
        conn = Connection("%s:%d" % srv.address, backend="tcp")
        big = [bytes([k]) + bytes(300 << 10) + bytes([k]) for k in range(6)]
        assert conn.request(big[0]) == b"\0\0" and conn.request(big[2]) == b"\2\2"
        assert seen[1] == seen[0]  # the first one's buffer, received into again
        assert conn.request(big[1]) == b"\1\1"  # this one is kept by the handler
        assert conn.request(big[3]) == b"\3\3"
        assert seen[3] != seen[2] and kept[0][0] == 1 and kept[0][-1] == 1  # never overwritten
        assert conn.request(b"\4small\4") == b"\4\4" and conn.request(big[5]) == b"\5\5"
        assert seen[5] == seen[3]  # a small one in between left the large one be
        third = bytes([7]) + bytes(100 << 10) + bytes([7])  # large, but under half: its own buffer
        assert conn.request(third) == b"\7\7" and conn.request(big[4]) == b"\4\4"
        assert seen[6] != seen[5] and seen[7] == seen[5]  # the large one kept its size for the next
        conn.close()
