"""ofl: the offload link. Registered memory, one-sided batched reads and messages between
the offload host and the engine hosts, on one API over three backends (verbs, tcp, shm)."""

from .client import Connection, Links
from .errors import (
    AuthenticationFailed,
    BackendUnavailable,
    ConfigurationError,
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
from .server import Server
from .wire import PROTOCOL_VERSION

__version__ = "0.1.0"

__all__ = [
    "AuthenticationFailed", "BackendUnavailable", "ConfigurationError", "Connection",
    "ConnectionLost", "DeadlineExceeded", "Links", "OflError", "OutOfRange", "PROTOCOL_VERSION", "PeerRejected", "ProtocolError", "Region",
    "RegionDescriptor", "RemoteError", "Server", "VersionMismatch",
]
