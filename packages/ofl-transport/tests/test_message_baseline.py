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
