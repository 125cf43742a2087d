"""async_handoff: remote rounds off the engine's path. Shared-memory host flags (a C helper
with C11 atomics and futexes), a torch-free proxy process that performs each round through
a caller-named adapter over ofl, and an engine-side Handoff with a watchdog and bounded
respawn. Protocol: csrc/hostflags.h."""

from .adapters import NullAdapter, OflMessageAdapter
from .env import async_enabled
from .hostflags import HostFlags, Ticket

__version__ = "0.1.0"
__all__ = ["Handoff", "HandoffConfig", "HostFlags", "NullAdapter", "OflMessageAdapter",
           "Ticket", "async_enabled"]


def __getattr__(name: str):
    # The Handoff is the engine's side (prometheus-client, a watchdog): loaded when first
    # named, so the proxy process, which imports this package, never loads it.
    if name in ("Handoff", "HandoffConfig"):
        from . import handoff
        return getattr(handoff, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
