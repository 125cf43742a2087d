"""The ofl client: one Connection per link, and Links for "rank r uses link r".

Every call has a deadline. When a call fails on the link (deadline, peer gone, framing
lost) the connection is dropped so no late reply can land in a caller's buffer; the next
call reconnects once, within its own deadline. A link the server closed while it was idle
is noticed before anything is sent on it, and re-opened. Error replies from a healthy
server raise RemoteError and keep the connection. With a shared key, the client checks the
server's proof before proving its own (ofl.admission). A link idle for a third of the
server's idle deadline is pinged from a background thread, so the server keeps it.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from . import admission, env, wire
from .backends import client_backend
from .channel import Channel
from .errors import (
    AuthenticationFailed,
    ConnectionLost,
    DeadlineExceeded,
    OflError,
    OutOfRange,
    PeerRejected,
    ProtocolError,
    RemoteError,
    VersionMismatch,
)
from .region import Region, RegionDescriptor
from .server import parse_address
from .stats import Stats

CHUNK_BYTES = 4 << 20  # a large read is split into pipelined READ frames of at most this


class Connection:
    """A connection to one ofl server over one link.

    >>> conn = Connection("10.0.0.1:7471", backend="verbs", link="spark0")
    >>> rows = Region.from_buffer("rows", np.empty(24 * 264, np.uint8))
    >>> conn.gather("engram-l1-r0", offsets, 264, into=rows)
    """

    def __init__(self, address: str | tuple[str, int], *, backend: str | None = None,
                 identity: str = "ofl-client", link: str | None = None,
                 deadline_s: float | None = None, connect_timeout_s: float | None = None,
                 max_inflight: int | None = None, connect: bool = True,
                 verify_peer: Callable[[dict], None] | None = None, key: str | None = None,
                 keepalive: bool = True, reconnect_in_calls: bool = True):
        self.address = parse_address(address) if isinstance(address, str) else tuple(address)
        self.backend_name = backend or env.OFL_BACKEND.get()
        self.identity = identity
        self.link = link
        self.deadline_s = deadline_s or env.OFL_DEADLINE_MS.get_float() / 1000
        self.connect_timeout_s = connect_timeout_s or env.OFL_CONNECT_TIMEOUT_MS.get_float() / 1000
        self.max_inflight = max_inflight or env.OFL_MAX_INFLIGHT.get_int()
        # proved to the server, and asked of it (OFL_AUTH_KEY or _FILE); never sent
        self._key = admission.configured_key(key)
        # Called with the server's metadata on every (re)connect, before any call uses the
        # link; raising refuses that server (e.g. it holds other tables than expected).
        self.verify_peer = verify_peer
        self.peer_metadata: dict = {}
        self.stats = Stats("ofl_client", {"backend": self.backend_name, "link": link or ""})
        self.regions: dict[str, RegionDescriptor] = {}
        self.peer_identity: str | None = None
        self.max_message_bytes = env.OFL_MAX_MESSAGE_BYTES.get_int()
        self.max_gather_rows = wire.MAX_GATHER_ROWS
        self.max_read_bytes = CHUNK_BYTES
        self._channel: Channel | None = None
        self._backend = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._connects = 0
        self._keepalive = keepalive
        # False: a call on a dropped link fails at once, and its owner reconnects
        # (ensure_connected) from a thread of its own, never the caller's hot one
        self._reconnect_in_calls = reconnect_in_calls
        self._idle_s = 0.0  # the server's idle deadline (0: none), from its HELLO_OK
        self._last_frame = time.monotonic()  # on the channel (verbs calls bypass it)
        self._closed = threading.Event()
        self._pinger: threading.Thread | None = None
        if connect:
            with self._lock:
                self._connect(time.monotonic() + self.connect_timeout_s)

    # -- set-up --------------------------------------------------------------------------
    def _connect(self, deadline: float) -> None:
        backend = client_backend(self.backend_name)
        try:
            # HELLO is ready before the socket opens (a verbs queue pair takes a while to
            # create): the server's short handshake deadline is for the wire only.
            nonce = admission.new_nonce()
            hello = {"identity": self.identity, "backend": self.backend_name, "link": self.link,
                     **({"auth": admission.AUTH_SCHEME, "nonce": nonce.hex()} if self._key else {}),
                     **backend.hello_extras()}
            sock = self._open_socket(deadline)
        except BaseException:
            backend.close()
            raise
        ch = Channel(sock, max_payload=1 << 40)
        try:
            ch.send_frame(wire.Kind.HELLO, 0, [wire.encode_json(hello)], deadline)
            header, payload = self._handshake_reply(ch, deadline)
            if self._key is not None:
                header, payload = self._prove_key(ch, header, payload, nonce, deadline)
            if header.kind != wire.Kind.HELLO_OK:
                raise ProtocolError(f"expected HELLO_OK from {self.where()}, got {header.kind.name}")
            reply = wire.decode_json(payload, "HELLO_OK")
            self.regions = {d.name: d for d in map(RegionDescriptor.from_json, reply.get("regions", []))}
            self.peer_identity = reply.get("identity")
            metadata = reply.get("metadata", {})
            if not isinstance(metadata, dict):
                raise ProtocolError("HELLO_OK metadata is not an object")
            if self.verify_peer is not None:
                try:
                    self.verify_peer(metadata)
                except OflError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the verifier's reason, as a refusal
                    self.stats.add("peers_rejected")
                    raise PeerRejected(f"{self.where()} rejected: {exc}") from None
            self.peer_metadata = metadata
            self.max_message_bytes = int(reply.get("max_message_bytes", self.max_message_bytes))
            self.max_gather_rows = int(reply.get("max_gather_rows", self.max_gather_rows))
            # a server from before the cap reads CHUNK_BYTES frames as it always did
            self.max_read_bytes = min(int(reply.get("max_read_bytes", CHUNK_BYTES)), CHUNK_BYTES)
            self._idle_s = float(reply.get("idle_timeout_s", 0))
            self._channel = ch
            backend.setup(self, reply)
        except BaseException:
            self._channel = None
            backend.close()
            ch.close()
            raise
        self._backend = backend
        self._last_frame = time.monotonic()
        self._connects += 1
        if self._connects > 1:
            self.stats.add("reconnects")
        if self._keepalive and self._idle_s > 0 and (self._pinger is None or self._closed.is_set()):
            self._closed = threading.Event()  # this link's: a pinger of a closed one ends
            self._pinger = threading.Thread(target=_keep_alive, args=(weakref.ref(self), self._closed),
                                            daemon=True, name=f"ofl-ping-{self.where()}")
            self._pinger.start()

    def _prove_key(self, ch: Channel, header: wire.Header, payload, nonce: bytes,
                   deadline: float) -> tuple[wire.Header, bytes]:
        """The server proves the key over our nonce first; then we prove it over its nonce.
        Returns the frame after our proof (HELLO_OK, or the server's refusal raised)."""
        if header.kind != wire.Kind.CHALLENGE:
            self.stats.add("auth_failures")
            raise AuthenticationFailed(
                f"{self.where()} asked for no key proof: it holds no shared key (or is not the "
                "server this client's OFL_AUTH_KEY is for); refusing it")
        challenge = wire.decode_json(payload, "CHALLENGE")
        if not admission.proof_matches(self._key, nonce, challenge.get("proof"),
                                       admission.SERVER_PROOF_LABEL):
            self.stats.add("auth_failures")
            raise AuthenticationFailed(
                f"{self.where()} could not prove the shared key (its OFL_AUTH_KEY differs from "
                "this client's, or it is not our server); refusing it")
        theirs = admission.hex_nonce(challenge.get("nonce"))
        if theirs is None:
            raise ProtocolError(f"CHALLENGE from {self.where()} carries no nonce")
        ch.send_frame(wire.Kind.PROOF, 0, [wire.encode_json(
            {"proof": admission.proof(self._key, theirs)})], deadline)
        return self._handshake_reply(ch, deadline)

    def _open_socket(self, deadline: float) -> socket.socket:
        try:
            return socket.create_connection(self.address,
                                            timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise DeadlineExceeded(f"connect to {self.where()} timed out") from None
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.where()}: {exc}") from None

    def _handshake_reply(self, ch: Channel, deadline: float) -> tuple[wire.Header, bytes]:
        """The server's next handshake frame; its refusal (ERROR) raised with its reason."""
        header = ch.recv_header(deadline)
        payload = ch.recv_payload(header, deadline) if header.length <= wire.MAX_CONTROL_BYTES \
            else b""
        if header.kind == wire.Kind.ERROR:
            message, code = wire.error_fields(payload)
            refusal = f"{self.where()} refused the connection: {message}"
            if code == "auth":
                raise AuthenticationFailed(refusal)
            if "version mismatch" in message:
                raise VersionMismatch(refusal)
            raise RemoteError(refusal)
        if header.kind == wire.Kind.CHALLENGE and not self._key:
            raise ProtocolError(f"{self.where()} asked for a key proof this client never offered")
        return header, payload

    def where(self) -> str:
        host, port = self.address
        return f"{host}:{port}" + (f" (link {self.link})" if self.link else "")

    def _drop(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _alive(self) -> bool:
        try:
            self.check_alive()
            return True
        except (ConnectionLost, OSError):
            return False

    def check_alive(self) -> None:
        """Raise ConnectionLost if the peer has closed the bootstrap socket (never blocks)."""
        poller = select.poll()
        poller.register(self._channel.sock, select.POLLIN)
        events = poller.poll(0)
        if not events:
            return
        if events[0][1] & (select.POLLHUP | select.POLLERR):
            raise ConnectionLost("peer gone")
        if not self._channel.sock.recv(1, socket.MSG_PEEK):
            raise ConnectionLost("peer closed the connection")

    def ensure_connected(self, deadline_s: float | None = None) -> None:
        """Connect now if not connected (handshake, verify_peer), within the deadline."""
        self._call("connect", deadline_s or self.connect_timeout_s, lambda deadline: None,
                   may_connect=True)

    @property
    def connected(self) -> bool:
        return self._channel is not None

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._drop()

    def ping(self, deadline_s: float | None = None) -> None:
        """One PING answered by PONG on the live link (no reconnect: a dead link stays
        dropped until the next call)."""
        with self._lock:
            if self._channel is None:
                raise ConnectionLost(f"no link to {self.where()}")
            deadline = time.monotonic() + (deadline_s or self.deadline_s)
            try:
                rid = next(self._ids)
                self._channel.send_frame(wire.Kind.PING, rid, (), deadline)
                self._expect(rid, wire.Kind.PONG, deadline)
            except OflError:
                self._drop()
                raise
            self._last_frame = time.monotonic()
            self.stats.add("pings")

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def region(self, name: str) -> RegionDescriptor:
        try:
            return self.regions[name]
        except KeyError:
            raise OflError(f"{self.where()} publishes no region {name!r} "
                           f"(it has: {', '.join(self.regions) or 'none'})") from None

    # -- calls ---------------------------------------------------------------------------
    def _call(self, what: str, deadline_s: float | None, fn, idempotent: bool = False,
              may_connect: bool | None = None):
        """Run fn(deadline) on a live link. An idempotent call (a read) that finds the link
        dead is retried once on a fresh connection within the same deadline, so a server
        restart costs no failed read; a message is never sent twice behind the caller's back.
        Without `may_connect` (reconnect_in_calls=False) a dropped link fails at once."""
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        may_connect = self._reconnect_in_calls if may_connect is None else may_connect
        with self._lock:
            for attempt in (0, 1):
                if self._channel is not None and not self._alive():
                    self._drop()  # the server closed it (idle deadline, restart): nothing sent yet
                    self.stats.add("links_reopened")
                fresh = self._channel is None
                if fresh and not may_connect:
                    self.stats.add("failures")
                    raise ConnectionLost(f"{what} via {self.where()}: not connected (the "
                                         "link is re-established off this thread)")
                try:
                    if fresh:
                        self._connect(deadline)
                    return fn(deadline)
                except (DeadlineExceeded, ConnectionLost, ProtocolError) as exc:
                    self._drop()
                    if (idempotent and not fresh and attempt == 0
                            and isinstance(exc, ConnectionLost)):
                        self.stats.add("retries")
                        continue
                    self.stats.add("failures")
                    self.stats.add("deadlines" if isinstance(exc, DeadlineExceeded)
                                   else "link_errors")
                    raise type(exc)(f"{what} via {self.where()}: {exc}") from None

    def read(self, region: str, offset: int, length: int, into, into_offset: int = 0, *,
             deadline_s: float | None = None) -> None:
        """Read `length` bytes at `offset` of the remote region into `into[into_offset:]`."""
        self.gather(region, np.array([offset], np.uint64), length, into, into_offset,
                    deadline_s=deadline_s)

    def gather(self, region: str, offsets, lengths, into, into_offset: int = 0, *,
               deadline_s: float | None = None) -> None:
        """Read many ranges of one remote region, back to back, into `into[into_offset:]`.

        `lengths` is one row length for all ranges (Engram rows) or one per range. All
        ranges are checked against the region before any request leaves this process.
        """
        offsets = np.ascontiguousarray(offsets, dtype=np.uint64).reshape(-1)
        if not isinstance(lengths, int | np.integer):
            lengths = np.ascontiguousarray(lengths, dtype=np.uint32).reshape(-1)
            if len(lengths) != len(offsets):
                raise ValueError(f"{len(offsets)} offsets but {len(lengths)} lengths")
        else:
            lengths = int(lengths)
        self._check(self.region(region), offsets, lengths)
        total = wire.ReadRequest(0, offsets, lengths).total_bytes
        dest = _dest_array(into, into_offset, total)
        if not len(offsets):
            return

        def run(deadline: float) -> None:
            # Resolved here, on the live connection: after a reconnect the server may list
            # its regions in another order (or no longer hold this one).
            desc = self.region(region)
            self._check(desc, offsets, lengths)
            if isinstance(into, Region):
                self._backend.register_local(into)
            self._backend.read(self, desc, offsets, lengths, dest, deadline)

        self._call(f"gather of {len(offsets)} ranges from {region!r}", deadline_s, run,
                   idempotent=True)
        self.stats.add("reads")
        self.stats.add("read_bytes", total)

    def _check(self, desc: RegionDescriptor, offsets, lengths) -> None:
        why = wire.check_ranges(offsets, lengths, desc.length)
        if why:
            self.stats.add("out_of_range")
            raise OutOfRange(f"region {desc.name!r}: {why}")

    def request(self, payload, *, deadline_s: float | None = None) -> bytes:
        """Send a message and wait for its reply. `payload`: bytes-like, or a list of
        bytes-like parts sent as one message (over tcp straight from each part, unjoined)."""
        parts = [memoryview(p).cast("B") for p in (payload if isinstance(payload, list) else [payload])]
        size = sum(len(p) for p in parts)
        if size > self.max_message_bytes:
            raise ValueError(f"message of {size} bytes exceeds the limit of "
                             f"{self.max_message_bytes}")
        reply = self._call("message", deadline_s,
                           lambda deadline: self._backend.request(self, parts, deadline))
        self.stats.add("messages")
        return reply

    # -- helpers the channel-carried backends use -----------------------------------------
    def channel_request(self, parts: list[memoryview], deadline: float) -> bytes:
        rid = next(self._ids)
        self._last_frame = time.monotonic()
        self._channel.send_frame(wire.Kind.MESSAGE, rid, parts, deadline)
        # The reply takes the server's whole turn: wait for it, where a receive tried at once
        # would find nothing (a system call for naught: dear where system calls are)
        if not self._channel.wait_readable(max(deadline - time.monotonic(), 0.0)):
            raise DeadlineExceeded("no reply within the deadline")
        header = self._expect(rid, wire.Kind.MESSAGE_REPLY, deadline)
        if header.length > self.max_message_bytes:
            raise ProtocolError(f"reply of {header.length} bytes exceeds the limit")
        return bytes(self._channel.recv_payload(header, deadline))

    def channel_read(self, desc: RegionDescriptor, offsets, lengths, dest: np.ndarray,
                     deadline: float) -> None:
        """READ frames, pipelined: up to max_inflight chunks in flight, replies in order."""
        chunks = list(_chunks(offsets, lengths, self.max_gather_rows, self.max_read_bytes))
        self._last_frame = time.monotonic()
        pending: list[tuple[int, int, int]] = []  # (request id, dest start, bytes)
        pos = 0
        it = iter(chunks)
        while True:
            while len(pending) < self.max_inflight:
                chunk = next(it, None)
                if chunk is None:
                    break
                req = wire.ReadRequest(desc.index, *chunk)
                rid = next(self._ids)
                self._channel.send_frame(wire.Kind.READ, rid, req.encode(), deadline)
                pending.append((rid, pos, req.total_bytes))
                pos += req.total_bytes
            if not pending:
                return
            rid, start, n = pending.pop(0)
            header = self._expect(rid, wire.Kind.READ_DATA, deadline)
            if header.length != n:
                raise ProtocolError(f"READ_DATA of {header.length} bytes, {n} expected")
            self._channel.recv_into(memoryview(dest[start:start + n]), deadline)

    def _expect(self, rid: int, kind: wire.Kind, deadline: float) -> wire.Header:
        header = self._channel.recv_header(deadline)
        if header.kind == wire.Kind.ERROR:
            message = wire.error_text(self._channel.recv_payload(header, deadline))
            # Replies still in flight would desynchronise the stream: start afresh.
            self._drop()
            self.stats.add("remote_errors")
            raise RemoteError(f"{self.where()}: {message}")
        if header.kind != kind or header.request_id != rid:
            raise ProtocolError(f"expected {kind.name} #{rid}, got {header.kind.name} "
                                f"#{header.request_id}")
        return header


class Links:
    """One connection per link: rank r of the engine uses link r (one per Spark)."""

    def __init__(self, addresses: Sequence[str], **kwargs):
        """Link i is named "link{i}"; kwargs go to every Connection."""
        self.connections = [Connection(a, link=f"link{i}", **kwargs)
                            for i, a in enumerate(addresses)]

    def for_rank(self, rank: int) -> Connection:
        if not 0 <= rank < len(self.connections):
            raise OflError(f"rank {rank} has no link ({len(self.connections)} configured)")
        return self.connections[rank]

    def __len__(self) -> int:
        return len(self.connections)

    def close(self) -> None:
        for c in self.connections:
            c.close()


def _keep_alive(ref: weakref.ref, closed: threading.Event) -> None:
    """Ping the connection's link whenever its channel has carried no frame for a third of
    the server's idle deadline (verbs calls do not use the channel: they ping too); ends when
    the connection is closed or collected (it is held only while this thread looks at it)."""
    while (conn := ref()) is not None and not closed.is_set():
        interval = conn._idle_s / 3
        wait = interval - (time.monotonic() - conn._last_frame) if conn.connected else interval
        del conn
        if closed.wait(max(wait, 0.05)):
            return
        conn = ref()
        if conn is not None and conn.connected and time.monotonic() - conn._last_frame >= interval:
            try:
                conn.ping(min(conn.deadline_s, interval))
            except OflError:
                pass  # dropped: the next call reconnects
        del conn


def _chunks(offsets: np.ndarray, lengths, max_rows: int, max_bytes: int):
    """Split ranges into READ frames of at most max_rows ranges and max_bytes bytes each (the
    server refuses larger ones); a range longer than max_bytes is split into pieces."""
    if isinstance(lengths, int):
        if lengths > max_bytes:
            for start in offsets.tolist():
                for o in range(0, lengths, max_bytes):
                    yield np.array([start + o], np.uint64), min(max_bytes, lengths - o)
            return
        rows = max(1, min(max_rows, max_bytes // max(lengths, 1)))
        for i in range(0, len(offsets), rows):
            yield offsets[i:i + rows], lengths
        return
    if len(lengths) and int(lengths.max()) > max_bytes:
        pieces = np.maximum(-(-lengths.astype(np.int64) // max_bytes), 1)
        nth = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        skip = nth * max_bytes
        offsets = np.repeat(offsets, pieces) + skip.astype(np.uint64)
        lengths = np.minimum(np.repeat(lengths.astype(np.int64), pieces) - skip,
                             max_bytes).astype(np.uint32)
    ends = np.cumsum(lengths, dtype=np.uint64)
    start, done = 0, 0
    while start < len(offsets):
        fits = int(np.searchsorted(ends, done + max_bytes, side="right"))
        stop = min(max(fits, start + 1), start + max_rows)
        yield offsets[start:stop], lengths[start:stop]
        start, done = stop, int(ends[stop - 1])


def _dest_array(into, into_offset: int, total: int) -> np.ndarray:
    arr = into.array if isinstance(into, Region) else np.frombuffer(memoryview(into).cast("B"),
                                                                     np.uint8)
    if isinstance(into, Region) and not into.writable or arr.flags.writeable is False:
        raise ValueError("the destination buffer is read-only")
    if into_offset < 0 or into_offset + total > len(arr):
        raise OutOfRange(f"destination holds {len(arr)} bytes; {total} bytes at offset "
                         f"{into_offset} do not fit")
    return arr[into_offset:into_offset + total]
