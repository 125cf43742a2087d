"""The adapter async_handoff's proxy loads for drafter rounds: an ofl message link that
checks the worker's identities on every (re)connect. It imports only the protocol side
(identity, protocol): no client, transport or metrics, and no torch."""

from __future__ import annotations

from async_handoff.adapters import OflMessageAdapter

from .identity import Manifest, check_worker


class DrafterProxyAdapter(OflMessageAdapter):
    def __init__(self, config: dict):
        super().__init__(config)
        self.verify_peer = check_worker(Manifest.from_json(config.get("expect", {})))
