"""The stack's read-only HTTP endpoints, GET /metrics (Prometheus text) and /health (JSON),
on one small server that a hostile or broken client cannot exhaust, and the one reader of
prefixed counters from such an endpoint.

MetricsServer answers one request per connection and closes it. It admits the peers of
the allow-list ofl servers use (OFL_ALLOW; empty = any), answering others 403 at accept. Bounded: at most
`max_connections` requests are served at once, one thread each, and more are answered 503
from the accepting thread without waiting on them; the whole request (at most
MAX_REQUEST_BYTES, no body) must arrive within `timeout_s` (a total, not per byte), and
the reply be sent within it; a bad request is answered 4xx. Each of those is counted and
logged as one rate-limited line (ofl.stats.PeerLog); the counters are appended to /metrics.

    endpoint = MetricsServer("127.0.0.1", 9480, metrics=server.metrics, health=server.health)
    read_counters("127.0.0.1:9480", "engram_server_")   # {"control_messages": 3.0, ...}
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from http import HTTPStatus

from . import admission, env
from .channel import accepted, send_and_close
from .stats import PeerLog, Stats

log = logging.getLogger("ofl.http")

MAX_REQUEST_BYTES = 8 << 10  # request line and headers; a GET for /metrics is ~100 bytes
PROMETHEUS_TEXT = "text/plain; version=0.0.4"


class BadRequest(Exception):
    def __init__(self, status: HTTPStatus, counter: str, reason: str):
        super().__init__(reason)
        self.status, self.counter = status, counter


class MetricsServer:
    """GET /metrics (`metrics()`, Prometheus text) and, when given, /health (`health()`, a
    JSON object) on host:port only. OSError when the address is taken. Stop it with
    shutdown() and server_close() (the standard library's socketserver names)."""

    def __init__(self, host: str, port: int, metrics: Callable[[], str],
                 health: Callable[[], dict] | None = None, *, name: str = "metrics",
                 max_connections: int | None = None, timeout_s: float | None = None,
                 allow: str | None = None):
        self.stats = Stats("ofl_http", {"endpoint": name})
        self.allow = admission.parse_allow(allow if allow is not None else env.OFL_ALLOW.get())
        self.routes = {"/metrics": lambda: (PROMETHEUS_TEXT,
                                            (metrics() + self.stats.prometheus()).encode())}
        if health is not None:
            self.routes["/health"] = lambda: ("application/json", json.dumps(health()).encode())
        self.max_connections = max_connections or env.OFL_HTTP_MAX_CONNECTIONS.get_int()
        self.timeout_s = timeout_s or env.OFL_HTTP_TIMEOUT_MS.get_float() / 1000
        self._listener = socket.create_server((host, port))
        self.drops = PeerLog(log, self.stats, f"{name} http://%s:%d" % self.address)
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=f"{name}-http")
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def shutdown(self) -> None:
        """Stop accepting (requests in flight finish within their deadline)."""
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        except OSError:
            pass
        self._thread.join(timeout=5)

    def server_close(self) -> None:
        self._listener.close()

    def _accept_loop(self) -> None:
        for sock, peer in accepted(self._listener, self._stopping):
            if not admission.admitted(peer[0], self.allow):
                self.drops.drop("%s:%d" % peer[:2], "peers_refused",
                                "not among the peers this endpoint admits (OFL_ALLOW)")
                send_and_close(sock, _response(HTTPStatus.FORBIDDEN, "text/plain",
                                               b"not admitted (OFL_ALLOW)\n"))
                continue
            if not self._slots.acquire(blocking=False):
                self.drops.drop("%s:%d" % peer[:2], "busy_refusals",
                                f"{self.max_connections} requests in flight already "
                                "(OFL_HTTP_MAX_CONNECTIONS)")
                send_and_close(sock, _response(HTTPStatus.SERVICE_UNAVAILABLE, "text/plain",
                                               b"busy: try again\n"))
                continue
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                             name="http-request").start()

    def _serve(self, sock: socket.socket, peer) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            status, kind, body = self._answer(sock, "%s:%d" % peer[:2], deadline)
            sock.settimeout(self.timeout_s)  # bounds the whole sendall, not each send
            sock.sendall(_response(status, kind, body))
            self.stats.add("requests")
        except OSError:
            self.stats.add("connections_lost")  # gone, or not reading its reply in time
        finally:
            sock.close()
            self._slots.release()

    def _answer(self, sock: socket.socket, peer: str, deadline: float) -> tuple:
        try:
            path = _request_path(_read_head(sock, deadline))
            route = self.routes.get(path)
            if route is None:
                raise BadRequest(HTTPStatus.NOT_FOUND, "not_found",
                                 f"no {path} here (try {', '.join(self.routes)})")
        except BadRequest as exc:
            self.drops.drop(peer, exc.counter, str(exc))
            return exc.status, "text/plain", f"{exc}\n".encode()
        try:
            return (HTTPStatus.OK, *route())
        except Exception:  # noqa: BLE001 - a bug in a route answers 500, the server stays up
            self.stats.add("internal_errors")
            log.exception("%s: %s failed", self.drops.where, path)
            return HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain", b"internal error\n"


def _read_head(sock: socket.socket, deadline: float) -> bytes:
    """Request line and headers, at most MAX_REQUEST_BYTES, all in by the deadline."""
    head = b""
    while b"\r\n\r\n" not in head:
        if len(head) > MAX_REQUEST_BYTES:
            raise BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "oversized_requests",
                             f"request over {MAX_REQUEST_BYTES} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise BadRequest(HTTPStatus.REQUEST_TIMEOUT, "request_timeouts",
                             f"request not complete in time ({len(head)} bytes received)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue  # the deadline check above answers 408
        if not chunk:
            raise OSError("the client closed before its request was complete")
        head += chunk
    return head


def _request_path(head: bytes) -> str:
    lines = head.split(b"\r\n")
    words = lines[0].split()
    if len(words) != 3 or not words[2].startswith(b"HTTP/"):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "bad_requests", "not an HTTP request line")
    if words[0] != b"GET":
        raise BadRequest(HTTPStatus.METHOD_NOT_ALLOWED, "bad_requests",
                         f"{words[0].decode(errors='replace')[:16]} is not GET")
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding" or (
                name.strip().lower() == b"content-length" and value.strip() != b"0"):
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "bad_requests", "a GET takes no body")
    return words[1].decode(errors="replace").split("?", 1)[0]


def _response(status: HTTPStatus, kind: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def parse_counters(text: str, prefix: str) -> dict[str, float]:
    """{name: value} of the counters and gauges named `prefix`* in Prometheus text, without
    the prefix and a counter's _total suffix, summed over their labels; other metrics (and
    histograms) are left out. Needs prometheus_client (ofl-transport[metrics])."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix) or family.type not in ("counter", "gauge"):
            continue
        wanted = family.name + ("_total" if family.type == "counter" else "")
        name = family.name.removeprefix(prefix)
        for sample in family.samples:
            if sample.name == wanted:
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def read_counters(address: str, prefix: str, timeout_s: float = 5) -> dict[str, float]:
    """parse_counters of GET http://HOST:PORT/metrics (OSError when nothing answers there)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
        return parse_counters(r.read().decode(), prefix)


def read_health(address: str, timeout_s: float = 5) -> dict:
    """GET http://HOST:PORT/health as JSON (OSError when nothing answers there)."""
    with urllib.request.urlopen(f"http://{address}/health", timeout=timeout_s) as r:
        return json.loads(r.read())
