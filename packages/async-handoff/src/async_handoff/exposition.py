"""The engine-side Handoff's counters for other processes. The counters (rounds ok, failed,
timed out, bad; stale replies; watchdog fires; respawns; enabled; mlocked) live in the
engine process that owns the Handoff, where no outside process can see them; with
ASYNC_HANDOFF_METRICS_LISTEN=HOST:PORT a started Handoff serves them, read-only, as
Prometheus text on GET /metrics (ofl.http's bounded MetricsServer: a connection cap, a
request deadline and size limit), and `read(listen)` is the reader (`async-handoff counters
--listen HOST:PORT`, the stack's status and canary; ofl.http's counter reader). Torch-free.

    counters = read("127.0.0.1:9496")   # {"rounds_ok": 2048.0, "watchdog_fires": 0.0, ...}
"""

from __future__ import annotations

from collections.abc import Callable

from ofl.http import MetricsServer, parse_counters, read_counters
from ofl.server import parse_address

PREFIX = "async_handoff_"
DEFAULT_PORT = 9496


def serve(metrics_text: Callable[[], str], listen: str) -> MetricsServer:
    """Serve GET /metrics (the text `metrics_text()` returns) on HOST:PORT; OSError if the
    address is taken. Stop it with .shutdown() and .server_close()."""
    return MetricsServer(*parse_address(listen, DEFAULT_PORT), metrics_text, name="async-handoff")


def parse(text: str) -> dict[str, float]:
    """{name: value} of the handoff's counters (without the async_handoff_ prefix and the
    _total suffix) and gauges, from Prometheus text; other metrics and the latency
    histogram are left out."""
    return parse_counters(text, PREFIX)


def read(listen: str, timeout_s: float = 5) -> dict[str, float]:
    """The counters a Handoff serves at HOST:PORT (OSError when nothing answers there)."""
    host, port = parse_address(listen, DEFAULT_PORT)
    return read_counters(f"{host}:{port}", PREFIX, timeout_s)
