"""The Handoff's counters endpoint against clients that never finish a request: it is
ofl.http's bounded server, so a flood of idle connections costs at most
OFL_HTTP_MAX_CONNECTIONS threads, the rest are answered 503 at once, the held ones are
dropped at the request deadline, and the rounds never notice."""

import socket
import threading
import time

from test_handoff import ECHO, Worker, config, free_address, round_trip

from async_handoff import Handoff
from async_handoff.exposition import read
from ofl.testing import http_status


def test_idle_clients_cost_bounded_threads_and_never_the_rounds(monkeypatch):
    monkeypatch.setenv("OFL_HTTP_MAX_CONNECTIONS", "2")
    monkeypatch.setenv("OFL_HTTP_TIMEOUT_MS", "300")
    worker, listen = Worker(), free_address()
    h = Handoff(config(metrics_listen=listen), ECHO,
                {"address": worker.address, "backend": "tcp"}).start()
    try:
        assert h.enabled, h.reason
        host, port = listen.rsplit(":", 1)
        before = threading.active_count()
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(50)]
        held = threading.active_count() - before
        assert round_trip(h, b"during the flood") is not None
        t = time.monotonic()
        codes = [http_status(s) for s in idle]
        assert held <= 2 and set(codes) == {408, 503} and codes.count(503) >= 40
        assert time.monotonic() - t < 2  # held ones dropped at 0.3 s
        assert read(listen)["rounds_ok"] == 1
    finally:
        h.close()
        worker.stop()
