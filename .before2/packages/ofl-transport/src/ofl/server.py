"""The ofl server: publishes registered regions and answers messages, on one backend.

One TCP listener bootstraps every connection (version, identity, the key proof, region
descriptors, and the backend's own set-up such as verbs queue-pair numbers). A thread per
connection serves it; bad input gets an error reply (or, when framing is lost, that
connection is dropped) and the server keeps serving the others.

Closed by default: it listens on loopback unless told otherwise, and an address other
hosts can reach needs an allow-list or a shared key, or an explicit insecure flag
(ofl.admission.exposure). Bounded against a hostile or broken peer: a peer outside the
allow-list is closed at accept, before it takes a slot; slots are capped per server and per
peer address; the handshake (and key proof, both ways) has a short deadline; a connection
that carries no frame for the idle deadline is closed; a frame, once its first byte is in,
has a total deadline, and so has each reply; payload buffers grow as bytes arrive; a READ's
reply is capped per request and streamed in bounded pieces. Each drop is one counted log
line, rate-limited (ofl.stats.PeerLog); a traceback means a bug in this code.

The message handler is called with the payload and the peer's address as this server saw
it at accept (never what the peer says of itself), so quotas can be kept per peer.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

import numpy as np

from . import admission, env, wire
from .backends import server_backend
from .channel import Channel, accepted, send_and_close
from .errors import ConnectionLost, DeadlineExceeded, OflError, ProtocolError, VersionMismatch
from .gather import gather_into
from .region import Region, RegionDescriptor
from .stats import PeerLog, Stats

log = logging.getLogger("ofl.server")

# (payload, peer address) -> reply; the payload is the handler's to keep (a buffer ofl
# received it into and never touches again: bytes or a bytearray)
Handler = Callable[[bytes | bytearray, str], bytes]
ZERO_COPY_MAX_RANGES = 64  # above this many ranges a READ is gathered into pieces first
READ_PIECE_BYTES = 256 << 10  # a gathered READ reply is copied and sent this much at a time


def parse_address(text: str, default_port: int = 0) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        return text, default_port
    return host.strip("[]"), int(port)


class Refused(OflError):
    """Why the server drops a peer: the counter it adds to, the reason (logged, and sent to
    the peer unless it stopped reading) and, for a client to tell it apart, an error code."""

    def __init__(self, counter: str, reason: str, code: str | None = None,
                 tell_peer: bool = True):
        super().__init__(reason)
        self.counter, self.code, self.tell_peer = counter, code, tell_peer


class Server:
    """Serve `regions` (and `handler` for messages) on `backend` at host:port.

    Limits and admission default to ofl.env (OFL_ALLOW, OFL_AUTH_KEY or _FILE, OFL_INSECURE,
    OFL_MAX_CONNECTIONS, OFL_MAX_CONNECTIONS_PER_PEER, OFL_HANDSHAKE_TIMEOUT_MS,
    OFL_IDLE_TIMEOUT_MS, OFL_FRAME_TIMEOUT_MS, OFL_MAX_READ_BYTES), read when the server is
    created. ConfigurationError when the address is exposed without admission.

    >>> srv = Server("tcp", "127.0.0.1", 0, identity="engram-host").start()
    >>> srv.register(Region.allocate("rows", 1 << 20))
    """

    def __init__(self, backend: str | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 identity: str = "ofl-server", handler: Handler | None = None,
                 max_connections: int | None = None, max_message_bytes: int | None = None,
                 metadata: dict | None = None, read_delay_s: float = 0.0,
                 allow: str | None = None, key: str | None = None, insecure: bool | None = None):
        self.backend_name = backend or env.OFL_BACKEND.get()
        self.allow = admission.parse_allow(allow if allow is not None else env.OFL_ALLOW.get())
        self._key = admission.configured_key(key)
        self.insecure = env.OFL_INSECURE.get() == "1" if insecure is None else insecure
        self.backend = server_backend(self.backend_name)
        self.identity = identity
        self.handler = handler
        self.metadata = metadata or {}  # JSON handed to every client in the handshake
        # testing: added to every read this process answers (a slow link on one machine;
        # one-sided verbs READs never reach it)
        self.read_delay_s = read_delay_s
        self.max_connections = max_connections or env.OFL_MAX_CONNECTIONS.get_int()
        self.max_per_peer = env.OFL_MAX_CONNECTIONS_PER_PEER.get_int()
        self.max_message_bytes = max_message_bytes or env.OFL_MAX_MESSAGE_BYTES.get_int()
        self.max_read_bytes = env.OFL_MAX_READ_BYTES.get_int()
        self.handshake_timeout_s = env.OFL_HANDSHAKE_TIMEOUT_MS.get_float() / 1000
        self.frame_timeout_s = env.OFL_FRAME_TIMEOUT_MS.get_float() / 1000
        self.idle_timeout_s = env.OFL_IDLE_TIMEOUT_MS.get_float() / 1000
        self.stats = Stats("ofl_server", {"backend": self.backend_name, "identity": identity})
        self.regions: list[Region] = []
        self.descriptors: list[RegionDescriptor] = []
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.exposure = admission.exposure(self.address[0], self.allow, self._key, self.insecure)
        except BaseException:
            self._listener.close()
            self.backend.close()
            raise
        if self.exposure == "insecure":
            log.warning("ofl server %s:%d admits any peer with no proof (--insecure / "
                        "OFL_INSECURE=1): set OFL_ALLOW or a shared key", *self.address)
        self.drops = PeerLog(log, self.stats, "ofl server %s:%d" % self.address)
        self._conns: dict[int, Channel] = {}
        self._per_peer: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def admission_status(self) -> dict:
        """Who this server admits, for status pages (never the key)."""
        return {"exposure": self.exposure, "allow": [str(n) for n in self.allow],
                "key": self._key is not None, "idle_timeout_s": self.idle_timeout_s}

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
        for sock, peer in accepted(self._listener, self._stopping):
            try:
                self._admit(peer)
            except Refused as exc:
                self._refuse(sock, _where(peer), exc)
                continue
            ch = Channel(sock, max_payload=self.max_message_bytes + wire.MAX_CONTROL_BYTES)
            with self._lock:
                self._conns[id(ch)] = ch
            threading.Thread(target=self._serve_connection, args=(ch, peer), daemon=True,
                             name=f"ofl-conn-{_where(peer)}").start()

    def _admit(self, peer) -> None:
        """Take a slot for this peer, or raise Refused (before any thread or buffer exists)."""
        host = peer[0]
        if not admission.admitted(host, self.allow):
            raise Refused("peers_refused", f"{host} is not among the peers this server admits "
                          "(OFL_ALLOW)")
        with self._lock:
            if len(self._conns) >= self.max_connections:
                raise Refused("connections_refused",
                              f"server full ({self.max_connections} connections)")
            if self._per_peer[host] >= self.max_per_peer:
                raise Refused("peer_limit_refusals", f"{host} already holds {self.max_per_peer} "
                              "connections (OFL_MAX_CONNECTIONS_PER_PEER)")
            self._per_peer[host] += 1

    def _refuse(self, sock: socket.socket, peer: str, why: Refused) -> None:
        self.drops.drop(peer, why.counter, str(why))
        body = wire.error_reply(str(why))
        send_and_close(sock, wire.pack_header(wire.Kind.ERROR, 0, len(body)) + body)

    def _serve_connection(self, ch: Channel, peer) -> None:
        where, session = _where(peer), None
        try:
            session = self._handshake(ch, where, peer)
            self.stats.add("connections")
            self._request_loop(ch, str(admission.peer_address(peer[0])))
        except Refused as exc:
            self.drops.drop(where, exc.counter, str(exc))
            if exc.tell_peer:
                self._send_error(ch, 0, str(exc), exc.code)
        except ProtocolError as exc:
            # Framing is lost (bad magic, truncated or oversized frame, bad JSON): tell the
            # peer why and drop only this connection.
            self.drops.drop(where, "protocol_errors", str(exc))
            self._send_error(ch, 0, str(exc))
        except DeadlineExceeded as exc:
            self.drops.drop(where, "frame_timeouts", f"dropped: {exc}")
        except ConnectionLost:
            self.stats.add("connections_lost")  # the peer went away: nothing to report
        except Exception:  # noqa: BLE001 - a bug in one connection must not stop the server
            self.stats.add("internal_errors")
            log.exception("connection %s failed", where)
        finally:
            if session is not None:
                session.close()
            with self._lock:
                self._conns.pop(id(ch), None)
                self._per_peer[peer[0]] -= 1
                if not self._per_peer[peer[0]]:
                    del self._per_peer[peer[0]]
            ch.close()

    def _handshake(self, ch: Channel, where: str, peer):
        deadline = _deadline(self.handshake_timeout_s)
        try:
            header, hello = self._recv_handshake(ch, wire.Kind.HELLO, deadline)
            if self._key is not None:
                self._check_key(ch, hello, deadline)
        except DeadlineExceeded:
            raise Refused("handshake_timeouts", "no complete handshake within "
                          f"{self.handshake_timeout_s:g} s (OFL_HANDSHAKE_TIMEOUT_MS)") from None
        if hello.get("backend") != self.backend_name:
            raise ProtocolError(f"backend mismatch: server runs {self.backend_name!r}, "
                                f"client asked for {hello.get('backend')!r}")
        try:
            session, extras = self.backend.accept(hello, self)
        except (TypeError, ValueError, OverflowError) as exc:  # a field of the wrong type or size
            raise ProtocolError(f"HELLO for the {self.backend_name} backend is malformed: "
                                f"{type(exc).__name__}: {exc}"[:300]) from None
        try:
            reply = {"identity": self.identity, "backend": self.backend_name,
                     "regions": [d.to_json() for d in self.descriptors],
                     "max_message_bytes": self.max_message_bytes,
                     "max_gather_rows": wire.MAX_GATHER_ROWS,
                     "max_read_bytes": self.max_read_bytes, "idle_timeout_s": self.idle_timeout_s,
                     "metadata": self.metadata, **extras}
            ch.send_frame(wire.Kind.HELLO_OK, header.request_id, [wire.encode_json(reply)],
                          _deadline(self.frame_timeout_s))
            if session is not None:
                session.start(self, str(admission.peer_address(peer[0])))
        except BaseException:
            if session is not None:  # the peer never got its session: free it (verbs: its QP)
                session.close()
            raise
        log.info("%s connected: identity=%r link=%r", where, hello.get("identity"),
                 hello.get("link"))
        return session

    def _recv_handshake(self, ch: Channel, kind: wire.Kind, deadline: float):
        """One frame of the handshake from the peer: its header and JSON body."""
        try:
            header = ch.recv_header(deadline)
        except VersionMismatch as exc:
            self.stats.add("version_mismatches")
            raise ProtocolError(str(exc)) from None
        if header.kind != kind:
            raise ProtocolError(f"expected {kind.name}, got {header.kind.name}")
        if header.length > wire.MAX_HELLO_BYTES:
            raise ProtocolError(f"{kind.name} of {header.length} bytes exceeds the handshake "
                                f"limit of {wire.MAX_HELLO_BYTES}")
        return header, wire.decode_json(ch.recv_payload(header, deadline), kind.name)

    def _check_key(self, ch: Channel, hello: dict, deadline: float) -> None:
        """Prove the shared key over the client's nonce, then have the client prove it over
        a fresh nonce of ours (ofl.admission), or refuse it."""
        theirs = admission.hex_nonce(hello.get("nonce"))
        if hello.get("auth") != admission.AUTH_SCHEME or theirs is None:
            raise Refused("auth_failures", "this server admits only clients that prove its "
                          "shared key: set OFL_AUTH_KEY on the client to the server's key",
                          code="auth")
        nonce = admission.new_nonce()
        ch.send_frame(wire.Kind.CHALLENGE, 0, [wire.encode_json({
            "nonce": nonce.hex(),
            "proof": admission.proof(self._key, theirs, admission.SERVER_PROOF_LABEL)})], deadline)
        _, answer = self._recv_handshake(ch, wire.Kind.PROOF, deadline)
        if not admission.proof_matches(self._key, nonce, answer.get("proof")):
            raise Refused("auth_failures", "key proof rejected: the client's OFL_AUTH_KEY "
                          "differs from the server's", code="auth")

    def _request_loop(self, ch: Channel, peer: str) -> None:
        scratch = np.empty(READ_PIECE_BYTES, np.uint8)  # pages appear only when first used
        while True:
            if not ch.wait_readable(self.idle_timeout_s or None):
                raise Refused("idle_closes", f"closed: no frame for {self.idle_timeout_s:g} s "
                              "(OFL_IDLE_TIMEOUT_MS)", tell_peer=False)
            deadline = _deadline(self.frame_timeout_s)
            header = ch.recv_header(deadline)
            payload = ch.recv_payload(header, deadline)
            if header.kind == wire.Kind.READ and self.backend.reads_over_channel:
                self._serve_read(ch, header.request_id, payload, scratch)
            elif header.kind == wire.Kind.PING:
                self._send_reply(ch, [wire.pack_header(wire.Kind.PONG, header.request_id, 0)])
            elif header.kind == wire.Kind.MESSAGE:
                reply = self.answer(payload, peer)
                if isinstance(reply, str):
                    self._send_error(ch, header.request_id, reply)
                else:
                    self._send_reply(ch, [wire.pack_header(wire.Kind.MESSAGE_REPLY,
                                                           header.request_id, len(reply)), reply])
            else:
                self.stats.add("bad_requests")
                self._send_error(ch, header.request_id,
                                 f"{header.kind.name} is not a request this server takes")
            del payload  # let go of it: the channel receives the next large one into it

    def _send_reply(self, ch: Channel, parts: list) -> None:
        try:
            ch.send_all(parts, _deadline(self.frame_timeout_s))
        except DeadlineExceeded:
            raise Refused("send_timeouts", f"reply not taken within {self.frame_timeout_s:g} s "
                          "(OFL_FRAME_TIMEOUT_MS): the peer stopped reading",
                          tell_peer=False) from None

    def answer(self, payload: bytes | bytearray, peer: str) -> bytes | str:
        """Run the message handler for `peer`; an error string instead of raising (any
        backend uses it)."""
        self.stats.add("messages")
        if self.handler is None:
            self.stats.add("bad_requests")
            return "this server has no message handler"
        try:
            reply = self.handler(payload, peer)
        except Exception as exc:  # noqa: BLE001 - the handler's failure goes back to the caller
            self.stats.add("handler_errors")
            return f"handler failed: {type(exc).__name__}: {exc}"
        if len(reply) > self.max_message_bytes:
            self.stats.add("handler_errors")
            return f"reply of {len(reply)} bytes exceeds the limit of {self.max_message_bytes}"
        return reply

    def _serve_read(self, ch: Channel, request_id: int, payload, scratch: np.ndarray) -> None:
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
        total = req.total_bytes
        if total > self.max_read_bytes:
            self.stats.add("oversized_reads")
            self._send_error(ch, request_id, f"READ of {total} bytes exceeds this server's limit "
                             f"of {self.max_read_bytes} per request (OFL_MAX_READ_BYTES): split it")
            return
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        head = wire.pack_header(wire.Kind.READ_DATA, request_id, total)
        if len(req.offsets) <= ZERO_COPY_MAX_RANGES:
            self._send_reply(ch, [head, *_views(region, req)])
        else:
            for piece in _gathered(region, req, scratch):
                self._send_reply(ch, [head, piece] if head else [piece])
                head = b""
        self.stats.add("reads")
        self.stats.add("read_bytes", total)

    def _send_error(self, ch: Channel, request_id: int, message: str,
                    code: str | None = None) -> None:
        try:
            body = wire.error_reply(message, code)
            ch.send_frame(wire.Kind.ERROR, request_id, [body], _deadline(1.0))
        except OflError:
            pass


def _views(region: Region, req: wire.ReadRequest) -> list[memoryview]:
    """Few ranges: sent straight from the region (no copy)."""
    if isinstance(req.lengths, int):
        n = req.lengths
        return [region.view[o:o + n] for o in req.offsets.tolist()]
    return [region.view[o:o + n] for o, n in zip(req.offsets.tolist(), req.lengths.tolist())]


def _gathered(region: Region, req: wire.ReadRequest, scratch: np.ndarray):
    """Many small ranges (Engram rows): copied into `scratch` a piece at a time, each piece
    yielded to be sent before the next overwrites it; a range longer than the scratch is
    yielded straight from the region. Memory per reply: the scratch, whatever was asked."""
    fixed = isinstance(req.lengths, int)
    ends = np.cumsum(np.broadcast_to(np.uint64(req.lengths), req.offsets.shape) if fixed
                     else req.lengths, dtype=np.uint64)
    start, done = 0, 0
    while start < len(req.offsets):
        stop = int(np.searchsorted(ends, done + len(scratch), side="right"))
        if stop == start:  # one range longer than the scratch
            stop, offset = start + 1, int(req.offsets[start])
            yield region.view[offset:offset + int(ends[start]) - done]
        else:
            size = int(ends[stop - 1]) - done
            gather_into(region.array, req.offsets[start:stop],
                        req.lengths if fixed else req.lengths[start:stop], scratch[:size])
            yield memoryview(scratch[:size])
        start, done = stop, int(ends[stop - 1])


def _where(peer) -> str:
    return "%s:%d" % peer[:2]


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds
