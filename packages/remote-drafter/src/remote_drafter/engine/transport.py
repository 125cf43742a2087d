"""How a client reaches a drafter: in its own process (local mode), over an ofl link
(synchronous rounds), or through async_handoff's torch-free proxy (asynchronous rounds).
Every transport answers info() (the worker's manifest and limits), call() or
submit()/wait(). Torch-free."""

from __future__ import annotations

import time

from async_handoff import Handoff, HandoffConfig
from ofl import Connection

from .client import WorkerInfo
from .identity import Manifest, check_worker

ADAPTER = "remote_drafter.engine.proxy_adapter:DrafterProxyAdapter"


def worker_stats(address: str, backend: str = "tcp") -> dict:
    """A worker's counters (requests held, rounds, failures...), asked over its own link."""
    from ofl import Connection

    from . import protocol as P
    with Connection(address, backend=backend, identity="remote-drafter-status") as conn:
        described = conn.peer_metadata.get("remote_drafter", {})
        fingerprint = Manifest.from_json(described["manifest"]).fingerprint
        return P.parse_stats_reply(conn.request(P.encode_request([], fingerprint, kind=P.KIND_STATS)))


class LocalTransport:
    """The drafter in the engine's own process: the stock configuration and the rollback."""

    max_round_bytes = 1 << 62  # no link in between

    def __init__(self, service):
        self.service = service
        self._info = WorkerInfo(service.describe())

    def info(self, deadline_s: float) -> WorkerInfo:
        return self._info

    def call(self, payload: bytes, deadline_s: float) -> bytes:
        return self.service.handle(payload)

    def invalidate(self) -> None:
        pass

    def close(self) -> None:
        self.service.close()


class RemoteTransport:
    """Synchronous rounds over one ofl link; reconnects (and re-checks identities) lazily,
    at most once per `retry_s` after a failure so a dead worker costs no step its deadline."""

    def __init__(self, address: str, backend: str = "tcp", expect: Manifest | None = None,
                 retry_s: float = 1.0, link: str | None = None):
        self.conn = Connection(address, backend=backend, identity="remote-drafter-client",
                               link=link, connect=False, verify_peer=check_worker(expect or Manifest()))
        self.retry_s, self._down_until, self._last_error = retry_s, 0.0, ""
        self._info: tuple[dict, WorkerInfo] | None = None

    def info(self, deadline_s: float) -> WorkerInfo:
        if not self.conn.connected:
            if time.monotonic() < self._down_until:
                raise ConnectionError(f"worker at {self.conn.where()} unavailable ({self._last_error}); "
                                      f"retrying every {self.retry_s:g} s")
            try:
                self.conn.ensure_connected(deadline_s)
            except Exception as exc:
                self._down_until, self._last_error = time.monotonic() + self.retry_s, str(exc)
                raise
        metadata = self.conn.peer_metadata
        if self._info is None or self._info[0] is not metadata:  # new handshake: new limits
            self._info = (metadata, WorkerInfo(metadata["remote_drafter"]))
        return self._info[1]

    @property
    def max_round_bytes(self) -> int:
        """The largest message the link carries (the smaller of both sides' limits)."""
        return self.conn.max_message_bytes

    def call(self, payload: bytes, deadline_s: float) -> bytes:
        try:
            return self.conn.request(payload, deadline_s=deadline_s)
        except Exception:
            if not self.conn.connected:
                self._down_until = time.monotonic() + self.retry_s
            raise

    def invalidate(self) -> None:
        """A round failed: nothing to forget (a reconnect re-reads the worker's description)."""

    def close(self) -> None:
        self.conn.close()


class AsyncTransport(RemoteTransport):
    """Rounds through the proxy process (async_handoff): submit now, wait later. The
    engine's own connection only fetches the worker's limits and identities."""

    asynchronous = True

    def __init__(self, address: str, backend: str = "tcp", expect: Manifest | None = None,
                 config: HandoffConfig | None = None, link: str | None = None):
        super().__init__(address, backend, expect, link=link)
        self.handoff = Handoff(config or HandoffConfig.from_env(), ADAPTER,
                               {"address": address, "backend": backend, "link": link,
                                "identity": "remote-drafter-proxy",
                                "expect": (expect or Manifest()).to_json()}).start()

    def info(self, deadline_s: float) -> WorkerInfo:
        """Fetched once, again after a failed round; the proxy re-checks identities on each
        of its reconnects and the worker checks every round's fingerprint."""
        if self._info is None:
            super().info(deadline_s)
            self.conn.close()  # the proxy holds the link that carries rounds
        return self._info[1]

    @property
    def max_round_bytes(self) -> int:
        return min(self.handoff.config.slot_bytes, self.conn.max_message_bytes)

    def invalidate(self) -> None:
        """A round failed: the worker may have been replaced; re-read its description."""
        self._info = None

    def submit(self, payload: bytes):
        return self.handoff.submit(payload)

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
