"""ofl.http: the bounded /metrics and /health server every package's endpoint runs, and
the one reader of prefixed Prometheus counters."""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from ofl.http import MAX_REQUEST_BYTES, MetricsServer, parse_counters, read_counters
from ofl.stats import Stats
from ofl.testing import http_status, wait_until


@pytest.fixture
def endpoint():
    stats = Stats("engram_client", {"rank": "0"})
    stats.add("fallbacks", 3)
    srv = MetricsServer("127.0.0.1", 0, stats.prometheus, lambda: {"ok": True}, name="test",
                        max_connections=4, timeout_s=0.3)
    yield srv, "%s:%d" % srv.address
    srv.shutdown()
    srv.server_close()


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def test_metrics_health_and_refusals(endpoint):
    srv, address = endpoint
    assert read_counters(address, "engram_client_") == {"fallbacks": 3.0}
    with urllib.request.urlopen(f"http://{address}/health", timeout=5) as r:
        assert json.load(r) == {"ok": True}
    for path, method, code in (("/nope", "GET", 404), ("/metrics", "POST", 405)):
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(urllib.request.Request(f"http://{address}{path}", method=method,
                                                          data=b"x" if method == "POST" else None),
                                   timeout=5)
        assert exc.value.code == code
    served = read_counters(address, "ofl_http_")  # its own counters ride on /metrics
    assert served["requests"] >= 2 and served["not_found"] == 1 and served["bad_requests"] == 1


def test_idle_clients_are_capped_and_dropped(endpoint):
    """200 idle connections were 200 threads held forever. Now 4 (the cap) are served at
    once and dropped at the deadline (408); the rest get 503 at once."""
    srv, address = endpoint
    before = threading.active_count()
    idle = [connect(address) for _ in range(200)]
    held = threading.active_count() - before
    t = time.monotonic()
    codes = [http_status(s) for s in idle]
    assert held <= 4 and set(codes) == {408, 503} and codes.count(503) > 100
    assert time.monotonic() - t < 2  # 0.3 s deadline, not held
    assert srv.stats["busy_refusals"] == codes.count(503)
    assert srv.stats["request_timeouts"] == codes.count(408)
    assert read_counters(address, "engram_client_") == {"fallbacks": 3.0}  # free again


def test_slow_and_oversized_requests_are_cut_off(endpoint):
    srv, address = endpoint
    slow = connect(address)
    t = time.monotonic()
    try:
        for byte in b"GET /metrics HTTP/1.1\r\n" * 10:  # one byte per 50 ms
            slow.send(bytes([byte]))
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        pass  # dropped mid-request
    assert time.monotonic() - t < 1.5
    assert http_status(slow) == 408
    big = connect(address)
    try:
        big.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * (6 << 20))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused after MAX_REQUEST_BYTES: the rest was never read
    assert http_status(big) == 431
    assert srv.stats["oversized_requests"] == 1 and MAX_REQUEST_BYTES == 8192


def test_parse_counters_sums_labels_and_keeps_counters_and_gauges():
    text = """# TYPE x_rounds_total counter
x_rounds_total{rank="0"} 2.0
x_rounds_total{rank="1"} 3.0
x_rounds_created 1.7e+09
# TYPE x_enabled gauge
x_enabled 1.0
# TYPE x_seconds histogram
x_seconds_bucket{le="0.1"} 1.0
x_seconds_count 1.0
# TYPE y_rounds_total counter
y_rounds_total 9.0
"""
    assert parse_counters(text, "x_") == {"rounds": 5.0, "enabled": 1.0}


def test_the_allow_list_of_ofl_servers_guards_the_endpoint_too(monkeypatch):
    """OFL_ALLOW admits the same peers here as at an ofl server: others get 403 at accept."""
    monkeypatch.setenv("OFL_ALLOW", "127.0.0.1")
    srv = MetricsServer("127.0.0.1", 0, lambda: "", name="guarded")
    try:
        host, port = srv.address
        assert read_counters(f"{host}:{port}", "ofl_http_") is not None  # from 127.0.0.1
        outsider = socket.create_connection((host, port), timeout=5, source_address=("127.0.0.2", 0))
        assert http_status(outsider) == 403
        # a reply is counted once sent: the client may read it before the count moves
        wait_until(lambda: srv.stats["requests"], lambda n: n == 1, "the admitted request counted")
        assert srv.stats["peers_refused"] == 1
    finally:
        srv.shutdown()
        srv.server_close()
