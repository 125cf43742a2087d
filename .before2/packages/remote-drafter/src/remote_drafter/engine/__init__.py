"""The engine side, torch-free: what runs in the engine's process (or the proxy) to reach a
drafter. `protocol` (the wire format), `identity` (digests and the handshake check),
`history` (a request's bounded tokens and rows), `client` (one round per step, fail closed),
`transport` (local, remote, through the proxy), `proxy_adapter` (what async_handoff's proxy
loads), `sampling` and `verify` (the draft and verification rules), `metrics`."""
