"""The client an engine gets from its environment (env.py): remote (synchronous, or
asynchronous through the proxy when VLLM_DSPARK_REMOTE_ASYNC is set) when
REMOTE_DRAFTER_ADDRESS is set, else local. Capacity mode forbids the local drafter: its
memory went to KV cache, so with no worker the engine decodes target-only."""

from __future__ import annotations

from async_handoff.env import async_enabled
from remote_drafter import env
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation


class CapacityModeError(RuntimeError):
    pass


def remote_async() -> bool:
    """make_client gives remote rounds through the proxy (an AsyncTransport): known from the
    environment alone, so the same on every engine rank, client or not."""
    return bool(env.REMOTE_DRAFTER_ADDRESS.get()) and async_enabled()


def make_client(target: str | None = None, **client_options) -> DrafterClient:
    target = target or env.REMOTE_DRAFTER_TARGET.get() or None
    address = env.REMOTE_DRAFTER_ADDRESS.get()
    if address:
        from remote_drafter.engine.transport import AsyncTransport, RemoteTransport
        expect = expectation(target, env.REMOTE_DRAFTER_MANIFEST.get() or None)
        backend = env.REMOTE_DRAFTER_BACKEND.get()
        transport = (AsyncTransport if remote_async() else RemoteTransport)(
            address, backend, expect, standbys=env.standbys())
        return DrafterClient(transport, **client_options)
    if env.capacity_mode():
        raise CapacityModeError(
            "REMOTE_DRAFTER_CAPACITY_MODE is set but REMOTE_DRAFTER_ADDRESS is empty: capacity "
            "mode never creates a local drafter (its memory is KV cache now). Set the worker "
            "address, or unset capacity mode and restore the baseline KV budget first.")
    spec = env.REMOTE_DRAFTER_DRAFTER.get()
    if not spec:
        raise ValueError("no drafter: set REMOTE_DRAFTER_ADDRESS (remote) or "
                         "REMOTE_DRAFTER_DRAFTER (local)")
    from remote_drafter.engine.transport import LocalTransport
    from remote_drafter.models.registry import load_drafter
    from remote_drafter.worker.service import DraftService
    return DrafterClient(LocalTransport(DraftService(load_drafter(spec, target))), **client_options)
