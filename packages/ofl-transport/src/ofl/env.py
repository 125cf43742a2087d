"""Every environment variable ofl reads, with its default and what it does.

Values are read when a Server or Connection is created; changing a variable in a running
process does nothing to objects that already exist.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_float(self) -> float:
        return float(self.get())

    def get_int(self) -> int:
        return int(self.get())


OFL_BACKEND = EnvVar(
    "OFL_BACKEND", "tcp",
    "Backend used when none is passed explicitly: verbs, tcp or shm. verbs without an RDMA "
    "device fails loudly; there is no silent fallback.")
OFL_DEADLINE_MS = EnvVar(
    "OFL_DEADLINE_MS", "5000",
    "Default deadline of one remote call (read, gather, message) in milliseconds.")
OFL_CONNECT_TIMEOUT_MS = EnvVar(
    "OFL_CONNECT_TIMEOUT_MS", "3000",
    "Deadline of connection set-up (TCP connect plus handshake) in milliseconds.")
OFL_MAX_INFLIGHT = EnvVar(
    "OFL_MAX_INFLIGHT", "8",
    "Requests a connection keeps in flight at once (pipelined chunks of a large read or "
    "gather; verbs: receive buffers posted for messages).")
OFL_MAX_MESSAGE_BYTES = EnvVar(
    "OFL_MAX_MESSAGE_BYTES", str(4 << 20),
    "Largest message payload accepted in either direction (bytes).")
OFL_IB_DEVICE = EnvVar(
    "OFL_IB_DEVICE", "",
    "verbs: RDMA device name (e.g. mlx5_0, rxe0); empty picks the first device.")
OFL_IB_PORT = EnvVar("OFL_IB_PORT", "1", "verbs: device port number.")
OFL_GID_INDEX = EnvVar(
    "OFL_GID_INDEX", "",
    "verbs: GID index to use; empty picks the port's first RoCE v2 IPv4 GID.")

ALL = [OFL_BACKEND, OFL_DEADLINE_MS, OFL_CONNECT_TIMEOUT_MS, OFL_MAX_INFLIGHT,
       OFL_MAX_MESSAGE_BYTES, OFL_IB_DEVICE, OFL_IB_PORT, OFL_GID_INDEX]


def describe(variables: list[EnvVar] | None = None) -> str:
    """One line per variable: name, default, doc (`ofl env` and other packages' CLIs)."""
    return "\n".join(f"{v.name} (default {v.default!r}): {v.doc}" for v in variables or ALL)
