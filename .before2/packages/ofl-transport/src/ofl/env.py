"""Every environment variable ofl reads, with its default and what it does.

Values are read when a Server, Connection or MetricsServer is created; changing a variable
in a running process does nothing to objects that already exist.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

KINDS = {  # what a value of each kind must be, as an error message says it
    "text": "",
    "int": "a whole number >= 0",
    "number": "a number >= 0",
    "flag": "0 or 1",
    "address": "HOST:PORT",
}


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    doc: str
    secret: bool = False  # its value is never printed (launchers show it redacted)
    kind: str = "text"    # a key of KINDS: what a value must be (launchers check env files with it)
    choices: tuple[str, ...] = ()  # words allowed besides values of `kind` (text: the only ones)

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def get_float(self) -> float:
        value = self.get()
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{self.name}={value!r} is not a number") from None

    def get_int(self) -> int:
        value = self.get()
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{self.name}={value!r} is not a whole number") from None

    def problem(self, value: str) -> str | None:
        """Why `value` is not one this variable takes (a line naming it), or None. Empty
        means unset where the default is empty."""
        if (value == "" and self.default == "") or value in self.choices:
            return None
        if self.kind == "text":
            ok = not self.choices
        elif self.kind == "int":
            ok = re.fullmatch(r"[0-9]+", value) is not None
        elif self.kind == "number":
            ok = re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", value) is not None
        elif self.kind == "flag":
            ok = value in ("0", "1")
        else:  # address
            host, _, port = value.rpartition(":")
            ok = bool(host) and re.fullmatch(r"[0-9]+", port) is not None and int(port) < 65536
        return None if ok else f"{self.name}={value!r}: expected {self.takes()}"

    def takes(self) -> str:
        """What a value must be, in words ('' for free text)."""
        return " or ".join(([KINDS[self.kind]] if self.kind != "text" else []) + [repr(c) for c in self.choices])


OFL_BACKEND = EnvVar(
    "OFL_BACKEND", "tcp",
    "Backend used when none is passed explicitly: verbs, tcp or shm. verbs without an RDMA "
    "device fails loudly; there is no silent fallback.",
    choices=("verbs", "tcp", "shm"))
OFL_DEADLINE_MS = EnvVar(
    "OFL_DEADLINE_MS", "5000",
    "Default deadline of one remote call (read, gather, message) in milliseconds.",
    kind="number")
OFL_CONNECT_TIMEOUT_MS = EnvVar(
    "OFL_CONNECT_TIMEOUT_MS", "3000",
    "Deadline of connection set-up (TCP connect plus handshake) in milliseconds.",
    kind="number")
OFL_MAX_INFLIGHT = EnvVar(
    "OFL_MAX_INFLIGHT", "8",
    "Requests a connection keeps in flight at once (pipelined chunks of a large read or "
    "gather; verbs: receive buffers posted for messages).",
    kind="int")
OFL_MAX_MESSAGE_BYTES = EnvVar(
    "OFL_MAX_MESSAGE_BYTES", str(4 << 20),
    "Largest message payload accepted in either direction (bytes).",
    kind="int")
OFL_IB_DEVICE = EnvVar(
    "OFL_IB_DEVICE", "",
    "verbs: RDMA device name (e.g. mlx5_0, rxe0); empty picks the first device.")
OFL_IB_PORT = EnvVar("OFL_IB_PORT", "1", "verbs: device port number.", kind="int")
OFL_GID_INDEX = EnvVar(
    "OFL_GID_INDEX", "",
    "verbs: GID index to use; empty picks the port's first RoCE v2 IPv4 GID.",
    kind="int")

OFL_ALLOW = EnvVar(
    "OFL_ALLOW", "",
    "Servers: the peers admitted, comma-separated addresses or networks (10.0.0.2, "
    "10.0.1.0/24, fd00::/64); any other peer is closed at accept, before it takes a "
    "connection slot. Empty = any peer that reaches the listener (a server on an address "
    "other hosts reach then needs a shared key or OFL_INSECURE=1, else it refuses to start).")
OFL_AUTH_KEY = EnvVar(
    "OFL_AUTH_KEY", "",
    "Shared key, at least 32 characters (generate: openssl rand -hex 32). A server with a key "
    "admits only clients that prove it (HMAC-SHA256 of a nonce the server picks per "
    "connection; the key never crosses the wire); a client with a key proves it when asked. "
    "Set the same key on every host; empty = no proof asked or given.", secret=True)
OFL_AUTH_KEY_FILE = EnvVar(
    "OFL_AUTH_KEY_FILE", "",
    "A file holding the shared key (what OFL_AUTH_KEY would hold), readable by its owner only "
    "(chmod 600; a file others may read is refused). Set one of the two.")
OFL_INSECURE = EnvVar(
    "OFL_INSECURE", "0",
    "Servers: 1 = listen on an address other hosts can reach with neither OFL_ALLOW nor a "
    "shared key (any peer admitted, no proof); logged as a warning and shown in status. "
    "Without it such a server refuses to start.",
    kind="flag")
OFL_IDLE_TIMEOUT_MS = EnvVar(
    "OFL_IDLE_TIMEOUT_MS", "300000",
    "Servers: a connection that carries no frame for this many milliseconds after its "
    "handshake is closed, so idle peers cannot hold slots; clients learn it in the handshake "
    "and ping a link idle for a third of it. 0 = no idle deadline.",
    kind="number")
OFL_MAX_CONNECTIONS = EnvVar(
    "OFL_MAX_CONNECTIONS", "64",
    "Servers: connections held at once, handshaking or served; more are refused.",
    kind="int")
OFL_MAX_CONNECTIONS_PER_PEER = EnvVar(
    "OFL_MAX_CONNECTIONS_PER_PEER", "8",
    "Servers: connections one peer address may hold at once (an engine rank needs one per "
    "link, plus status and preflight checks).",
    kind="int")
OFL_HANDSHAKE_TIMEOUT_MS = EnvVar(
    "OFL_HANDSHAKE_TIMEOUT_MS", "2000",
    "Servers: a peer must complete its handshake (HELLO, and the key proof) within this "
    "many milliseconds of being accepted, or its slot is reclaimed.",
    kind="number")
OFL_FRAME_TIMEOUT_MS = EnvVar(
    "OFL_FRAME_TIMEOUT_MS", "5000",
    "Servers: once the first byte of a request arrives, the whole frame must arrive within "
    "this many milliseconds (a total, not per byte), and each reply be sent within it; a "
    "peer that sends or reads slower is dropped. Between frames: OFL_IDLE_TIMEOUT_MS.",
    kind="number")
OFL_MAX_READ_BYTES = EnvVar(
    "OFL_MAX_READ_BYTES", str(4 << 20),
    "Servers (tcp): the largest reply to one READ frame, bytes; clients learn it in the "
    "handshake and split larger gathers. Engram asks ~3 KiB per token and rank; qualify "
    "and probe ask 4 MiB frames.",
    kind="int")
OFL_HTTP_MAX_CONNECTIONS = EnvVar(
    "OFL_HTTP_MAX_CONNECTIONS", "8",
    "HTTP endpoints (/metrics, /health): requests served at once, one thread each; more "
    "are answered 503 and closed. They admit the peers of OFL_ALLOW, as ofl servers do.",
    kind="int")
OFL_HTTP_TIMEOUT_MS = EnvVar(
    "OFL_HTTP_TIMEOUT_MS", "2000",
    "HTTP endpoints: the whole request must arrive within this many milliseconds (408 "
    "otherwise), and the reply be sent within it.",
    kind="number")

ALL = [OFL_BACKEND, OFL_DEADLINE_MS, OFL_CONNECT_TIMEOUT_MS, OFL_MAX_INFLIGHT,
       OFL_MAX_MESSAGE_BYTES, OFL_IB_DEVICE, OFL_IB_PORT, OFL_GID_INDEX, OFL_ALLOW,
       OFL_AUTH_KEY, OFL_AUTH_KEY_FILE, OFL_INSECURE, OFL_IDLE_TIMEOUT_MS, OFL_MAX_CONNECTIONS,
       OFL_MAX_CONNECTIONS_PER_PEER, OFL_HANDSHAKE_TIMEOUT_MS, OFL_FRAME_TIMEOUT_MS, OFL_MAX_READ_BYTES,
       OFL_HTTP_MAX_CONNECTIONS, OFL_HTTP_TIMEOUT_MS]


def describe(variables: list[EnvVar] | None = None) -> str:
    """One line per variable: name, default, doc (`ofl env` and other packages' CLIs)."""
    return "\n".join(f"{v.name} (default {v.default!r}): {v.doc}" for v in variables or ALL)
