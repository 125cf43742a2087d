"""Adapters perform one remote round for the proxy. The caller names one in the proxy's
configuration as "module:Class"; the proxy imports it lazily and calls:

    adapter = Class(config: dict)      # no I/O yet
    peer = adapter.connect()           # reach the peer (self-test); returns a description
    reply = adapter.round(request, deadline_s)   # raise TimeoutError past the deadline
    adapter.close()

An adapter must not import torch, nor its package's engine side: the proxy is a small
torch-free process (its status lists the packages it loaded, under "imports").
"""

from __future__ import annotations

import time


class NullAdapter:
    """Answers every round at once with its request (measures the handoff alone)."""

    def __init__(self, config: dict):
        self.config = config

    def connect(self) -> str:
        return "null (in-process echo)"

    def round(self, request: bytes, deadline_s: float) -> bytes:
        return request

    def close(self) -> None:
        pass


def pool_order(size: int, current: int, moving_on: bool) -> list[int]:
    """The order to try a pool's peers in: from `current`, or from the one after it when
    `moving_on` (its link just failed), round the pool."""
    first = (current + 1) % size if moving_on else current
    return [(first + i) % size for i in range(size)]


class OflMessageAdapter:
    """Sends the request as one ofl message and returns the reply.
    config: {"address": "HOST:PORT", "standbys": ["HOST:PORT", ...], "backend": "tcp",
    "identity": "..."}. A round whose link fails or times out is reported failed; the next
    one connects again, to the next peer of the pool first (the first is the primary; with
    one peer, to it again), so a dead or frozen peer is passed by. A subclass may set verify_peer (called with the server's handshake
    metadata; raising refuses that server) to check identities on every (re)connect."""

    verify_peer = None

    def __init__(self, config: dict):
        self.config = config
        self.addresses = [config["address"], *config.get("standbys", [])]
        self.current = 0
        self.conn = None
        self.failed = False  # the last round's link failed: move on before the next

    def connect(self, deadline_s: float | None = None) -> str:
        """Reach a peer of the pool (within `deadline_s`, else each within the link's
        connect timeout); raises the last peer's error when none answers."""
        from ofl import Connection

        end = None if deadline_s is None else time.monotonic() + deadline_s
        error = None
        for index in pool_order(len(self.addresses), self.current, self.failed):
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                self.conn = Connection(self.addresses[index], backend=self.config.get("backend"),
                                       identity=self.config.get("identity", "async-handoff-proxy"),
                                       link=self.config.get("link"), verify_peer=self.verify_peer,
                                       connect_timeout_s=left)
            except Exception as exc:  # noqa: BLE001 - this peer is away: the next
                error = exc
                continue
            self.current = index
            return f"{self.conn.peer_identity} at {self.addresses[index]} ({self.conn.backend_name})"
        raise error or TimeoutError("no time left to connect")

    def round(self, request: bytes, deadline_s: float) -> bytes:
        from ofl import DeadlineExceeded, OflError

        started = time.monotonic()
        if self.conn is None or self.failed:
            self.connect(deadline_s)
            self.failed = False
        try:
            return self.conn.request(request, deadline_s=max(deadline_s - (time.monotonic() - started), 1e-3))
        except OflError as exc:
            self.failed = True  # the next round connects again, the next peer first
            self.close()
            if isinstance(exc, DeadlineExceeded):
                raise TimeoutError(str(exc)) from None
            raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
