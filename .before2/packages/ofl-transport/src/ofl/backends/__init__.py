"""Backends share one API; each module holds the server half and the client half of one.

tcp   - a server thread answers READ frames with zero-copy sends into the client's buffer.
shm   - same host: the client maps the server's file-backed regions; a read is a copy.
verbs - RC queue pairs over RoCE v2: RDMA READ for reads, SEND/RECV for messages.
"""

from __future__ import annotations

from ..errors import BackendUnavailable

NAMES = ("verbs", "tcp", "shm")


def _module(name: str):
    if name == "tcp":
        from . import tcp as mod
    elif name == "shm":
        from . import shm as mod
    elif name == "verbs":
        from . import verbs as mod
    else:
        raise BackendUnavailable(f"unknown backend {name!r}: choose one of {', '.join(NAMES)}")
    return mod


def server_backend(name: str):
    return _module(name).ServerBackend()


def client_backend(name: str):
    return _module(name).ClientBackend()
