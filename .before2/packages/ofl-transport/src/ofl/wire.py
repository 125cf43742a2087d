"""The ofl wire protocol: one frame format for every control and data message.

Frame = 24-byte header + payload.  Header (little endian):
    u32 magic "OFL1" | u16 version | u16 kind | u64 request_id | u64 payload_length
Every header is validated (magic, version, kind, length bound) before its payload is read.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .errors import ProtocolError, VersionMismatch

MAGIC = 0x314C464F  # b"OFL1" read as a little-endian u32
PROTOCOL_VERSION = 1
HEADER = struct.Struct("<IHHQQ")
HEADER_SIZE = HEADER.size  # 24
MAX_CONTROL_BYTES = 1 << 20  # handshake / error JSON
MAX_HELLO_BYTES = 64 << 10  # what a client sends in the handshake (a HELLO is < 1 KiB)
MAX_JSON_DEPTH = 32  # nesting of any JSON read from the wire (ours is 4 deep at most)
MAX_GATHER_ROWS = 1 << 16  # rows per READ frame; clients split larger gathers
READ_HEAD = struct.Struct("<III")  # region index, count, row length (0: per-row lengths follow)


class Kind(IntEnum):
    HELLO = 1
    HELLO_OK = 2
    ERROR = 3
    READ = 4
    READ_DATA = 5
    MESSAGE = 6
    MESSAGE_REPLY = 7
    CHALLENGE = 8  # server -> client: its key proof, and a nonce to prove the key over (ofl.admission)
    PROOF = 9  # client -> server: the proof
    PING = 10  # client -> server: keeps an idle link inside the server's idle deadline
    PONG = 11


@dataclass(frozen=True)
class Header:
    kind: Kind
    request_id: int
    length: int


def pack_header(kind: Kind, request_id: int, length: int, version: int = PROTOCOL_VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, int(kind), request_id, length)


def unpack_header(raw: bytes, max_payload: int) -> Header:
    """Validate and decode a header; raises ProtocolError / VersionMismatch."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
    magic, version, kind, request_id, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x} (not an ofl peer?)")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version mismatch: peer speaks {version}, "
                              f"this side speaks {PROTOCOL_VERSION}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if length > max_payload:
        raise ProtocolError(f"{kind.name} payload of {length} bytes exceeds the limit of {max_payload}")
    return Header(kind, request_id, length)


def encode_json(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# A JSON string literal, escapes included (the unrolled form: no backtracking blow-up).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of `raw` nest, counted without parsing (so without
    recursion): brackets outside string literals, as a running sum."""
    skeleton = np.frombuffer(_JSON_STRING.sub(b'""', raw), np.uint8)
    opens = (skeleton == ord("[")) | (skeleton == ord("{"))
    closes = (skeleton == ord("]")) | (skeleton == ord("}"))
    return int(np.cumsum(opens.astype(np.int32) - closes, dtype=np.int64).max(initial=0))


def decode_json(payload, what: str, max_bytes: int = MAX_CONTROL_BYTES) -> dict:
    """A JSON object from the wire, at most `max_bytes` long and MAX_JSON_DEPTH deep;
    anything else is a ProtocolError (never a RecursionError)."""
    if len(payload) > max_bytes:
        raise ProtocolError(f"{what}: {len(payload)} bytes of JSON exceed the limit of {max_bytes}")
    raw = bytes(payload)
    brackets = raw.count(b"[") + raw.count(b"{")  # fewer than the limit cannot nest deeper
    if brackets > MAX_JSON_DEPTH and (depth := json_depth(raw)) > MAX_JSON_DEPTH:
        raise ProtocolError(f"{what}: JSON nested {depth} deep (the limit is {MAX_JSON_DEPTH})")
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or a number too long to convert
        raise ProtocolError(f"{what}: payload is not JSON we take ({exc})"[:300]) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    return obj


def error_reply(message: str, code: str | None = None) -> bytes:
    """An ERROR frame's payload; `code` lets a client tell a kind of refusal (e.g. "auth")
    from the rest without reading the message."""
    return encode_json({"error": message, **({"code": code} if code else {})})


def error_fields(payload) -> tuple[str, str | None]:
    """The message and code of an ERROR frame's payload, never raising."""
    try:
        obj = decode_json(payload, "ERROR")
    except ProtocolError:
        return "unreadable error reply", None
    code = obj.get("code")
    return str(obj.get("error", "unspecified error")), code if isinstance(code, str) else None


def error_text(payload) -> str:
    """The message of an ERROR frame's payload, never raising."""
    return error_fields(payload)[0]


@dataclass(frozen=True)
class ReadRequest:
    """A batched read: `count` ranges of one region, concatenated into one reply."""

    region: int
    offsets: np.ndarray  # uint64
    lengths: np.ndarray | int  # uint32 array, or one row length for all

    @property
    def total_bytes(self) -> int:
        if isinstance(self.lengths, int):
            return self.lengths * len(self.offsets)
        return int(self.lengths.sum(dtype=np.uint64))

    def encode(self) -> list:
        """Payload buffers (header + arrays, no copy of the offsets)."""
        fixed = isinstance(self.lengths, int)
        head = READ_HEAD.pack(self.region, len(self.offsets), self.lengths if fixed else 0)
        parts = [head, np.ascontiguousarray(self.offsets, dtype="<u8").data]
        if not fixed:
            parts.append(np.ascontiguousarray(self.lengths, dtype="<u4").data)
        return parts

    @classmethod
    def decode(cls, payload) -> ReadRequest:
        if len(payload) < READ_HEAD.size:
            raise ProtocolError(f"READ payload of {len(payload)} bytes is shorter than its head")
        region, count, row = READ_HEAD.unpack_from(payload)
        if count == 0 or count > MAX_GATHER_ROWS:
            raise ProtocolError(f"READ of {count} ranges (allowed 1..{MAX_GATHER_ROWS})")
        expect = READ_HEAD.size + 8 * count + (0 if row else 4 * count)
        if len(payload) != expect:
            raise ProtocolError(f"READ payload is {len(payload)} bytes, {expect} expected for "
                                f"{count} ranges")
        offsets = np.frombuffer(payload, dtype="<u8", count=count, offset=READ_HEAD.size)
        if row:
            return cls(region, offsets, row)
        lengths = np.frombuffer(payload, dtype="<u4", count=count, offset=READ_HEAD.size + 8 * count)
        return cls(region, offsets, lengths)


def check_ranges(offsets: np.ndarray, lengths: np.ndarray | int, region_length: int) -> str | None:
    """Why the ranges fall outside [0, region_length), or None when all are inside.

    Unsigned arithmetic cannot wrap here: each length is checked against the region first.
    """
    if len(offsets) == 0:
        return None
    if isinstance(lengths, int) and lengths <= region_length \
            and int(offsets.max()) <= region_length - lengths:
        return None  # fast path for fixed-length rows: one reduction
    lengths_u = np.asarray(lengths, dtype=np.uint64)
    if np.any(lengths_u > region_length):
        return f"a range is longer than the region ({region_length} B)"
    limit = np.uint64(region_length) - lengths_u
    bad = np.flatnonzero(offsets > limit)
    if bad.size:
        i = int(bad[0])
        length = int(lengths_u if lengths_u.ndim == 0 else lengths_u[i])
        return (f"range {i}: [{int(offsets[i])}, {int(offsets[i]) + length}) is outside "
                f"[0, {region_length}) ({bad.size} ranges out of bounds)")
    return None
