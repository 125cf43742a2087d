"""async_handoff: remote rounds off the engine's path. Shared-memory host flags (a C helper
with C11 atomics and futexes), a torch-free proxy process that performs each round through
a caller-named adapter over ofl, and an engine-side Handoff with a watchdog and bounded
respawn. Protocol: csrc/hostflags.h."""

from .adapters import NullAdapter, OflMessageAdapter
from .env import async_enabled
from .handoff import Handoff, HandoffConfig
from .hostflags import HostFlags, Ticket

__version__ = "0.1.0"
__all__ = ["Handoff", "HandoffConfig", "HostFlags", "NullAdapter", "OflMessageAdapter",
           "Ticket", "async_enabled"]
