"""The engine-side Handoff's counters for other processes. The counters (rounds ok, failed,
timed out, bad; stale replies; watchdog fires; respawns; enabled; mlocked) live in the
engine process that owns the Handoff, where no outside process can see them; with
ASYNC_HANDOFF_METRICS_LISTEN=HOST:PORT a started Handoff serves them, read-only, as
Prometheus text on GET /metrics from a daemon thread, and `read(listen)` is the reader
(`async-handoff counters --listen HOST:PORT`, the stack's status and canary). Torch-free:
the standard library and prometheus_client only.

    counters = read("127.0.0.1:9496")   # {"rounds_ok": 2048.0, "watchdog_fires": 0.0, ...}
"""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.parser import text_string_to_metric_families

from ofl.server import parse_address

PREFIX = "async_handoff_"


def serve(metrics_text, listen: str) -> ThreadingHTTPServer:
    """Serve GET /metrics (the text `metrics_text()` returns) on HOST:PORT; OSError if the
    address is taken. Stop it with .shutdown() and .server_close()."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = metrics_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(parse_address(listen, 9496), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="handoff-metrics").start()
    return httpd


def parse(text: str) -> dict[str, float]:
    """{name: value} of the handoff's counters (without the async_handoff_ prefix and the
    _total suffix) and gauges, from Prometheus text; other metrics and the latency
    histogram are left out."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX) or family.type not in ("counter", "gauge"):
            continue
        wanted = family.name + ("_total" if family.type == "counter" else "")
        for sample in family.samples:
            if sample.name == wanted:
                out[family.name.removeprefix(PREFIX)] = float(sample.value)
    return out


def read(listen: str, timeout_s: float = 5) -> dict[str, float]:
    """The counters a Handoff serves at HOST:PORT (OSError when nothing answers there)."""
    host, port = parse_address(listen, 9496)
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as r:
        return parse(r.read().decode())
