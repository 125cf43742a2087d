"""The ofl server: publishes registered regions and answers messages, on one backend.

One TCP listener bootstraps every connection (version, identity, region descriptors, and
the backend's own set-up such as verbs queue-pair numbers). A thread per connection serves
it; bad input gets an error reply (or, when framing is lost, that connection is dropped)
and the server keeps serving the others.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from . import env, wire
from .backends import server_backend
from .channel import Channel
from .errors import ConnectionLost, DeadlineExceeded, OflError, ProtocolError, VersionMismatch
from .gather import gather_into
from .region import Region, RegionDescriptor
from .stats import Stats

log = logging.getLogger("ofl.server")

Handler = Callable[[bytes], bytes]
ZERO_COPY_MAX_RANGES = 64  # above this many ranges a READ is gathered into one buffer first


def parse_address(text: str, default_port: int = 0) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        return text, default_port
    return host.strip("[]"), int(port)


class Server:
    """Serve `regions` (and `handler` for messages) on `backend` at host:port.

    >>> srv = Server("tcp", "127.0.0.1", 0, identity="engram-host").start()
    >>> srv.register(Region.allocate("rows", 1 << 20))
    """

    def __init__(self, backend: str | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 identity: str = "ofl-server", handler: Handler | None = None,
                 max_connections: int = 64, max_message_bytes: int | None = None,
                 handshake_timeout_s: float | None = None, metadata: dict | None = None,
                 read_delay_s: float = 0.0):
        self.backend_name = backend or env.OFL_BACKEND.get()
        self.backend = server_backend(self.backend_name)
        self.identity = identity
        self.handler = handler
        self.metadata = metadata or {}  # JSON handed to every client in the handshake
        # testing: added to every read this process answers (a slow link on one machine;
        # one-sided verbs READs never reach it)
        self.read_delay_s = read_delay_s
        self.max_connections = max_connections
        self.max_message_bytes = max_message_bytes or env.OFL_MAX_MESSAGE_BYTES.get_int()
        self.handshake_timeout_s = (handshake_timeout_s if handshake_timeout_s is not None
                                    else env.OFL_CONNECT_TIMEOUT_MS.get_float() / 1000)
        self.stats = Stats("ofl_server", {"backend": self.backend_name, "identity": identity})
        self.regions: list[Region] = []
        self.descriptors: list[RegionDescriptor] = []
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._conns: dict[int, Channel] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def register(self, region: Region) -> RegionDescriptor:
        """Publish a region; connections made after this call see it."""
        if any(r.name == region.name for r in self.regions):
            raise ValueError(f"a region named {region.name!r} is already registered")
        index = len(self.regions)
        extras = self.backend.publish(region)
        desc = RegionDescriptor(region.name, region.length, index, extras)
        self.regions.append(region)
        self.descriptors.append(desc)
        return desc

    def start(self) -> Server:
        self._accept_thread = threading.Thread(target=self._accept_loop, name="ofl-accept",
                                               daemon=True)
        self._accept_thread.start()
        return self

    def serve_forever(self) -> None:
        self.start()
        self._stopping.wait()

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns.values())
        for ch in conns:
            ch.close()
        if self._accept_thread:
            self._accept_thread.join(timeout=5)
        self.backend.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- connections ---------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            ch = Channel(sock, max_payload=self.max_message_bytes + wire.MAX_CONTROL_BYTES)
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns[id(ch)] = ch
            if full:
                self.stats.add("connections_refused")
                self._send_error(ch, 0, f"server full ({self.max_connections} connections)")
                ch.close()
                continue
            threading.Thread(target=self._serve_connection, args=(ch, peer), daemon=True,
                             name=f"ofl-conn-{peer}").start()

    def _serve_connection(self, ch: Channel, peer) -> None:
        session = None
        try:
            session = self._handshake(ch)
            self.stats.add("connections")
            self._request_loop(ch, session)
        except (ConnectionLost, DeadlineExceeded):
            pass
        except ProtocolError as exc:
            # Framing is lost (bad magic, truncated or oversized frame): tell the peer why
            # and drop only this connection.
            self.stats.add("protocol_errors")
            log.warning("dropping %s: %s", peer, exc)
            self._send_error(ch, 0, str(exc))
        except Exception:  # noqa: BLE001 - a bug in one connection must not stop the server
            self.stats.add("internal_errors")
            log.exception("connection %s failed", peer)
        finally:
            if session is not None:
                session.close()
            with self._lock:
                self._conns.pop(id(ch), None)
            ch.close()

    def _handshake(self, ch: Channel):
        deadline = _deadline(self.handshake_timeout_s)
        try:
            header = ch.recv_header(deadline)
        except VersionMismatch as exc:
            self.stats.add("version_mismatches")
            raise ProtocolError(str(exc)) from None
        if header.kind != wire.Kind.HELLO or header.length > wire.MAX_CONTROL_BYTES:
            raise ProtocolError(f"expected HELLO, got {header.kind.name}")
        hello = wire.decode_json(ch.recv_payload(header, deadline), "HELLO")
        if hello.get("backend") != self.backend_name:
            raise ProtocolError(f"backend mismatch: server runs {self.backend_name!r}, "
                                f"client asked for {hello.get('backend')!r}")
        session, extras = self.backend.accept(hello, self)
        reply = {"identity": self.identity, "backend": self.backend_name,
                 "regions": [d.to_json() for d in self.descriptors],
                 "max_message_bytes": self.max_message_bytes,
                 "max_gather_rows": wire.MAX_GATHER_ROWS, "metadata": self.metadata, **extras}
        ch.send_frame(wire.Kind.HELLO_OK, header.request_id, [wire.encode_json(reply)], deadline)
        log.info("%s connected: identity=%r link=%r", ch.sock.getpeername(),
                 hello.get("identity"), hello.get("link"))
        if session is not None:
            session.start(self)
        return session

    def _request_loop(self, ch: Channel, session) -> None:
        while True:
            header = ch.recv_header(None)
            payload = ch.recv_payload(header, _deadline(self.handshake_timeout_s))
            if header.kind == wire.Kind.READ and self.backend.reads_over_channel:
                self._serve_read(ch, header.request_id, payload)
            elif header.kind == wire.Kind.MESSAGE:
                reply = self.answer(bytes(payload))
                if isinstance(reply, str):
                    self._send_error(ch, header.request_id, reply)
                else:
                    ch.send_frame(wire.Kind.MESSAGE_REPLY, header.request_id, [reply])
            else:
                self.stats.add("bad_requests")
                self._send_error(ch, header.request_id,
                                 f"{header.kind.name} is not a request this server takes")

    def answer(self, payload: bytes) -> bytes | str:
        """Run the message handler; an error string instead of raising (any backend uses it)."""
        self.stats.add("messages")
        if self.handler is None:
            self.stats.add("bad_requests")
            return "this server has no message handler"
        try:
            reply = self.handler(payload)
        except Exception as exc:  # noqa: BLE001 - the handler's failure goes back to the caller
            self.stats.add("handler_errors")
            return f"handler failed: {type(exc).__name__}: {exc}"
        if len(reply) > self.max_message_bytes:
            self.stats.add("handler_errors")
            return f"reply of {len(reply)} bytes exceeds the limit of {self.max_message_bytes}"
        return reply

    def _serve_read(self, ch: Channel, request_id: int, payload) -> None:
        try:
            req = wire.ReadRequest.decode(payload)
        except ProtocolError as exc:
            self.stats.add("bad_requests")
            self._send_error(ch, request_id, str(exc))
            return
        if req.region >= len(self.regions):
            self.stats.add("bad_requests")
            self._send_error(ch, request_id, f"no region with index {req.region}")
            return
        region = self.regions[req.region]
        why = wire.check_ranges(req.offsets, req.lengths, region.length)
        if why:
            self.stats.add("out_of_range")
            self._send_error(ch, request_id, f"out of range: region {region.name!r}: {why}")
            return
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        total = req.total_bytes
        if len(req.offsets) > ZERO_COPY_MAX_RANGES:
            # Many small rows: one vectorised copy into a scratch buffer beats thousands of
            # iovecs built in Python (Engram batches are 24 rows per token).
            body = [np.empty(total, np.uint8)]
            gather_into(region.array, req.offsets, req.lengths, body[0])
        elif isinstance(req.lengths, int):
            n = req.lengths
            body = [region.view[o:o + n] for o in req.offsets.tolist()]
        else:
            body = [region.view[o:o + n] for o, n in zip(req.offsets.tolist(), req.lengths.tolist())]
        ch.send_all([wire.pack_header(wire.Kind.READ_DATA, request_id, total), *body], None)
        self.stats.add("reads")
        self.stats.add("read_bytes", total)

    def _send_error(self, ch: Channel, request_id: int, message: str) -> None:
        try:
            ch.send_frame(wire.Kind.ERROR, request_id, [wire.encode_json({"error": message})],
                          _deadline(1.0))
        except OflError:
            pass


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds
