"""How a client reaches a drafter: in its own process (local mode), over an ofl link
(synchronous rounds), or through async_handoff's torch-free proxy (asynchronous rounds).
Every transport answers info() (the worker's manifest and limits), call() or
submit()/wait(). The engine thread never connects or handshakes: a link that is down is
re-established by a background thread while rounds fail at once (target-only decoding
meanwhile); only start-up asks with connect=True. Torch-free."""

from __future__ import annotations

import logging
import threading
import time

from async_handoff import Handoff, HandoffConfig
from async_handoff.adapters import pool_order
from ofl import Connection

from .client import WorkerInfo
from .identity import Manifest, check_worker

ADAPTER = "remote_drafter.engine.proxy_adapter:DrafterProxyAdapter"
log = logging.getLogger("remote_drafter.engine.transport")


def worker_stats(address: str, backend: str = "tcp", pings: int = 0) -> dict:
    """A worker's counters (requests held, rounds, failures, its round p50/p99...), asked
    over its own link; with `pings`, also `link_rtt_ms`: the median round trip of that many
    PINGs on that link (what the link adds to a round besides its payload)."""
    from . import protocol as P
    with Connection(address, backend=backend, identity="remote-drafter-status") as conn:
        described = conn.peer_metadata.get("remote_drafter")
        if not isinstance(described, dict) or "manifest" not in described:
            raise P.ProtocolError(f"{address} is an ofl server but not a drafter worker "
                                  f"(it describes itself as {sorted(conn.peer_metadata)})")
        fingerprint = Manifest.from_json(described["manifest"]).fingerprint
        trips = []
        for _ in range(pings):
            t0 = time.perf_counter()
            conn.ping(5.0)
            trips.append(time.perf_counter() - t0)
        stats = P.parse_stats_reply(conn.request(P.encode_request([], fingerprint, kind=P.KIND_STATS)))
        return {**stats, "link_rtt_ms": 1e3 * sorted(trips)[len(trips) // 2]} if trips else stats


class LocalTransport:
    """The drafter in the engine's own process: the stock configuration and the rollback."""

    max_round_bytes = 1 << 62  # no link in between

    def __init__(self, service):
        self.service = service
        self._info = WorkerInfo(service.describe())

    def info(self, deadline_s: float, connect: bool = False) -> WorkerInfo:
        return self._info

    def call(self, parts: list, deadline_s: float) -> bytes:
        """`parts`: the request's buffers (protocol.request_parts), joined for the service."""
        return self.service.handle(b"".join(parts))

    def invalidate(self) -> None:
        pass

    def close(self) -> None:
        self.service.close()


class RemoteTransport:
    """Synchronous rounds over one ofl link to a worker of the pool: the primary at
    `address`, else the first of `standbys` that answers. A dropped link is re-established
    (identities re-checked) by a background thread, an attempt every `retry_s` until one
    succeeds: the next worker of the pool first, round the pool back to the one it was on
    (a failover; with one worker, to it again). Rounds fail at once meanwhile; the new
    worker does not know the requests, so the client re-opens them (windows only)."""

    moves_on = True  # a reconnect tries the next worker first: rounds leave a failed one

    def __init__(self, address: str, backend: str = "tcp", expect: Manifest | None = None,
                 retry_s: float = 1.0, link: str | None = None, standbys: tuple[str, ...] = ()):
        self.addresses = [address, *standbys]
        self.backend, self.link, self.verify = backend, link, check_worker(expect or Manifest())
        self.current = 0  # the pool member rounds go to
        self.conn = self._connection(0)
        self.retry_s, self._last_error = retry_s, "not connected yet"
        self.errors: dict[str, str] = {}  # address -> why it last failed to connect
        self._info: tuple[dict, WorkerInfo] | None = None
        self._reconnector: threading.Thread | None = None
        self._closed = threading.Event()
        self.reconnects = 0  # background attempts that succeeded
        self.failovers = 0  # of them, those that moved to another worker of the pool
        try:  # at creation (start-up), within OFL_CONNECT_TIMEOUT_MS; else in the background
            self.conn.ensure_connected()
        except Exception as exc:  # noqa: BLE001 - no worker yet: rounds fail until it answers
            self._last_error = self.errors[address] = str(exc)
            self.reconnect_soon()

    def _connection(self, index: int) -> Connection:
        return Connection(self.addresses[index], backend=self.backend, identity="remote-drafter-client",
                          link=self.link, connect=False, reconnect_in_calls=False,
                          verify_peer=self.verify)

    def info(self, deadline_s: float, connect: bool = False) -> WorkerInfo:
        """The worker's description; `connect`: connect now if need be (start-up only),
        else a link that is down raises at once and is re-established in the background."""
        if not self.conn.connected:
            if not connect:
                self.reconnect_soon()
                raise ConnectionError(f"worker at {self.conn.where()} unavailable "
                                      f"({self._last_error}); reconnecting in the background")
            self.conn.ensure_connected(deadline_s)
        metadata = self.conn.peer_metadata
        if self._info is None or self._info[0] is not metadata:  # new handshake: new limits
            self._info = (metadata, WorkerInfo(metadata["remote_drafter"]))
        return self._info[1]

    @property
    def max_round_bytes(self) -> int:
        """The largest message the link carries (the smaller of both sides' limits)."""
        return self.conn.max_message_bytes

    def call(self, parts: list, deadline_s: float) -> bytes:
        """`parts`: the request's buffers, sent unjoined."""
        try:
            return self.conn.request(parts, deadline_s=deadline_s)
        except Exception as exc:
            if not self.conn.connected:  # the link is gone: the pool's next worker, or this again
                self.errors[self.addresses[self.current]] = f"{type(exc).__name__}: {exc}"
                self.reconnect_soon()
            raise

    def reconnect_soon(self) -> None:
        """Start the background reconnection unless one is running."""
        if self._closed.is_set() or (self._reconnector is not None and self._reconnector.is_alive()):
            return
        self._reconnector = threading.Thread(target=self._reconnect, daemon=True,
                                             name=f"remote-drafter-reconnect-{self.conn.where()}")
        self._reconnector.start()

    def _reconnect(self) -> None:
        while not self._closed.is_set():
            for index in pool_order(len(self.addresses), self.current, self.moves_on):
                conn = self.conn if index == self.current else self._connection(index)
                try:
                    conn.ensure_connected()
                except Exception as exc:  # noqa: BLE001 - this one is away: the next
                    self._last_error = self.errors[self.addresses[index]] = str(exc)
                    if conn is not self.conn:
                        conn.close()
                    continue
                if index != self.current:
                    was = self.addresses[self.current]
                    old, self.conn, self.current = self.conn, conn, index
                    old.close()
                    self.failovers += 1
                    log.warning("drafter worker %s unavailable (%s): rounds go to %s now", was,
                                self.errors.get(was, "its link was lost"), self.addresses[index])
                self.reconnects += 1
                return
            self._closed.wait(self.retry_s)

    def pool(self) -> list[dict]:
        """Each worker of the pool: address, primary or standby, whether rounds go to it,
        and why it last failed to connect."""
        return [{"address": a, "role": "primary" if i == 0 else "standby",
                 "current": i == self.current, "last_error": self.errors.get(a, "")}
                for i, a in enumerate(self.addresses)]

    def invalidate(self) -> None:
        """A round failed: nothing to forget (a reconnect re-reads the worker's description)."""

    def close(self) -> None:
        self._closed.set()
        self.conn.close()


class AsyncTransport(RemoteTransport):
    """Rounds through the proxy process (async_handoff): submit now, wait later. The
    engine's own connection only fetches the worker's limits and identities."""

    asynchronous = True
    moves_on = False  # this link only reads limits; the proxy picks the worker for rounds

    def __init__(self, address: str, backend: str = "tcp", expect: Manifest | None = None,
                 config: HandoffConfig | None = None, link: str | None = None,
                 standbys: tuple[str, ...] = ()):
        self._stale = False  # a round failed: read the worker's description again
        super().__init__(address, backend, expect, link=link, standbys=standbys)
        self.handoff = Handoff(config or HandoffConfig.from_env(), ADAPTER,
                               {"address": address, "standbys": list(standbys), "backend": backend,
                                "link": link, "identity": "remote-drafter-proxy",
                                "expect": (expect or Manifest()).to_json()}).start()

    def info(self, deadline_s: float, connect: bool = False) -> WorkerInfo:
        """Fetched at start-up, and read again once the background reconnect after a failed
        round has reached a worker (the pool's members share identities, so the limits
        known meanwhile stay good: rounds go on, and the proxy finds the worker). The proxy
        re-checks identities on each of its reconnects; the worker checks every round's
        fingerprint."""
        if self._info is None or (self._stale and self.conn.connected):
            self._stale = False
            super().info(deadline_s, connect)
            self.conn.close()  # the proxy holds the link that carries rounds
        return self._info[1]

    @property
    def max_round_bytes(self) -> int:
        return min(self.handoff.config.slot_bytes, self.conn.max_message_bytes)

    def invalidate(self) -> None:
        """A round failed: the worker may have been replaced; its description is read again
        in the background."""
        self._stale = True
        self.reconnect_soon()

    def submit(self, parts: list):
        """`parts`: the request's buffers, joined into the handoff's slot."""
        return self.handoff.submit(b"".join(parts))

    def wait(self, ticket) -> bytes | None:
        """The reply, waited for until the round's deadline (from its submission), never
        longer than the handoff's max wait; None past it."""
        left = self.handoff.config.round_deadline_ms / 1000 - (time.monotonic() - ticket.submitted)
        return self.handoff.wait(ticket, max(left, 0.0))

    def abandon(self, ticket) -> None:
        self.handoff.abandon(ticket)

    def close(self) -> None:
        self.handoff.close()
        super().close()
