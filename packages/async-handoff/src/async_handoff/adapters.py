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


class OflMessageAdapter:
    """Sends the request as one ofl message and returns the reply.
    config: {"address": "HOST:PORT", "backend": "tcp", "identity": "..."}
    A subclass may set verify_peer (called with the server's handshake metadata; raising
    refuses that server) to check identities on every (re)connect."""

    verify_peer = None

    def __init__(self, config: dict):
        self.config = config
        self.conn = None

    def connect(self) -> str:
        from ofl import Connection

        self.conn = Connection(self.config["address"], backend=self.config.get("backend"),
                               identity=self.config.get("identity", "async-handoff-proxy"),
                               link=self.config.get("link"), verify_peer=self.verify_peer)
        return f"{self.conn.peer_identity} at {self.config['address']} ({self.conn.backend_name})"

    def round(self, request: bytes, deadline_s: float) -> bytes:
        from ofl import DeadlineExceeded

        try:
            return self.conn.request(request, deadline_s=deadline_s)
        except DeadlineExceeded as exc:
            raise TimeoutError(str(exc)) from None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
