"""The drafter wire protocol (version 1), carried as ofl messages (where a round sits in a
step: ARCHITECTURE.md § Drafting data path). Torch-free. One request holds one entry per
running request of the engine, so a step costs one round trip and the worker drafts a batch:

    RequestHeader (32 B): magic "DRQ1", version u16, kind u16, fingerprint 16 B,
                          n_entries u32, client_id u32
    per entry: Entry (48 B), tokens int32[n_tokens], rows[n_rows x feature] (row_dtype)
    ReplyHeader (16 B): magic "DRP1", version u16, kind u16, n_entries u32, vocab u32
    per entry: ReplyEntry (24 B), tokens int32[n_drafts], probs float32[n_drafts x vocab]
               when has_probs, message utf-8[msg_len]

An entry opens a request (its bounded history and `length`, the count of tokens committed in
all, which fixes positions), continues one (the tokens committed since, their hidden rows,
and `length` after them: a worker holding another count answers "unknown request", so the
client re-opens) or releases one; `k` asks for up to k drafts (0: just record the tokens).
Requests are named (client_id, request_id) within the sender's address, which the worker
takes from the connection; the fingerprint is the manifest digest both sides agreed on in
the handshake. A malformed message is refused whole (an ofl error reply); a bad entry gets
status INVALID (QUOTA: an open past its address's quota) and a message, while the other
entries are served.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from ofl.errors import ProtocolError as WireError
from ofl.wire import decode_json

from . import rows as rows_module

VERSION = 1
REQUEST_MAGIC = b"DRQ1"
REPLY_MAGIC = b"DRP1"
KIND_ROUND, KIND_STATS = 1, 2
OP_CONTINUE, OP_OPEN, OP_RELEASE = 0, 1, 2
FLAG_WANT_PROBS = 1
STATUS_OK, STATUS_UNKNOWN, STATUS_CAPACITY, STATUS_INVALID, STATUS_RELEASED, STATUS_QUOTA = range(6)
STATUS_NAMES = ["ok", "unknown_request", "capacity", "invalid", "released", "quota"]
MAX_MESSAGE_BYTES = 480  # a reply entry's status message is cut here (clients budget for it)
MAX_LENGTH = 1 << 40     # positions beyond this are refused (no real request gets there)
CACHE_NONE, CACHE_HIT, CACHE_MISS = 0, 1, 2
ROW_NONE, ROW_F32, ROW_F16, ROW_BF16 = 0, 1, 2, 3
ROW_DTYPES = {"float32": ROW_F32, "float16": ROW_F16, "bfloat16": ROW_BF16}
ROW_BYTES = {ROW_NONE: 0, ROW_F32: 4, ROW_F16: 2, ROW_BF16: 2}
ROW_CODE_DTYPES = {code: rows_module.DTYPES[name] for name, code in ROW_DTYPES.items()}

REQUEST_HEADER = np.dtype([("magic", "S4"), ("version", "<u2"), ("kind", "<u2"),
                           ("fingerprint", "S16"), ("n_entries", "<u4"), ("client_id", "<u4")])
ENTRY = np.dtype([("request_id", "<u8"), ("seed", "<u8"), ("length", "<u8"), ("temperature", "<f4"),
                  ("n_tokens", "<u4"), ("n_rows", "<u4"), ("feature", "<u4"), ("k", "<u2"),
                  ("op", "u1"), ("flags", "u1"), ("row_dtype", "u1"), ("pad", "u1", (3,))])
REPLY_HEADER = np.dtype([("magic", "S4"), ("version", "<u2"), ("kind", "<u2"),
                         ("n_entries", "<u4"), ("vocab", "<u4")])
REPLY_ENTRY = np.dtype([("request_id", "<u8"), ("latency_us", "<u4"), ("n_drafts", "<u2"),
                        ("status", "u1"), ("cache", "u1"), ("has_probs", "u1"), ("pad", "u1"),
                        ("msg_len", "<u2"), ("pad2", "u1", (4,))])
# ENTRY and REPLY_ENTRY as struct packs and reads them: per entry, without numpy scalars
ENTRY_FIELDS, REPLY_FIELDS = struct.Struct("<QQQfIIIHBBB3x"), struct.Struct("<QIHBBBxH4x")
assert (REQUEST_HEADER.itemsize, ENTRY.itemsize, ENTRY_FIELDS.size, REPLY_HEADER.itemsize,
        REPLY_ENTRY.itemsize, REPLY_FIELDS.size) == (32, 48, 48, 16, 24, 24)


class ProtocolError(ValueError):
    """A message that cannot be parsed or is not for this worker; refused whole."""


@dataclass
class Entry:
    request_id: int
    op: int = OP_CONTINUE
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rows: np.ndarray | None = None   # [n_rows, feature] as sent (rows.DTYPES) once decoded
    k: int = 0
    temperature: float = 0.0
    seed: int = 0
    want_probs: bool = False
    feature: int = 0                 # as sent (rows may be None when n_rows == 0)
    length: int = 0                  # tokens committed in all, these included (positions)


@dataclass
class Request:
    kind: int
    client_id: int
    entries: list[Entry]


@dataclass
class Reply:
    request_id: int
    status: int = STATUS_OK
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    probs: np.ndarray | None = None  # float32 [n_drafts, vocab]
    cache: int = CACHE_NONE
    latency_us: int = 0
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK


# -- requests ------------------------------------------------------------------------------
def encode_request(entries: list[Entry], fingerprint: bytes, row_dtype: str = "float32",
                   kind: int = KIND_ROUND, client_id: int = 0) -> bytes:
    return b"".join(request_parts(entries, fingerprint, row_dtype, kind, client_id))


def request_parts(entries: list[Entry], fingerprint: bytes, row_dtype: str = "float32",
                  kind: int = KIND_ROUND, client_id: int = 0) -> list:
    """The request as the buffers it is made of, in order (a link sends them unjoined). Rows
    go as they are when they already have the wire's type (a bf16 engine's rows do), else
    are cast once."""
    head = np.zeros((), REQUEST_HEADER)
    head["magic"], head["version"], head["kind"] = REQUEST_MAGIC, VERSION, kind
    head["fingerprint"], head["n_entries"], head["client_id"] = fingerprint, len(entries), client_id
    code, dtype = ROW_DTYPES[row_dtype], rows_module.DTYPES[row_dtype]
    parts = [head.tobytes()]
    for e in entries:
        tokens = np.ascontiguousarray(e.tokens, np.int32).reshape(-1)
        rows = e.rows if e.rows is not None and len(e.rows) else None
        n_rows, feature = (0, 0) if rows is None else rows.shape
        parts += [ENTRY_FIELDS.pack(e.request_id, e.seed, e.length, e.temperature, len(tokens), n_rows, feature,
                                    e.k, e.op, FLAG_WANT_PROBS if e.want_probs else 0,
                                    ROW_NONE if rows is None else code), tokens.view(np.uint8)]
        if rows is not None:
            parts.append(np.ascontiguousarray(rows_module.cast(rows, dtype)).reshape(-1).view(np.uint8))
    return parts


def parse_request(buf: bytes, fingerprint: bytes | None, max_entries: int = 4096,
                  max_bytes_per_entry: int = 64 << 20) -> Request:
    """A request; ProtocolError when the message as a whole is unusable."""
    if len(buf) < REQUEST_HEADER.itemsize:
        raise ProtocolError(f"request of {len(buf)} bytes is shorter than its header")
    head = np.frombuffer(buf, REQUEST_HEADER, 1)[0]
    if bytes(head["magic"]) != REQUEST_MAGIC:
        raise ProtocolError(f"bad magic {bytes(head['magic'])!r} (not a drafter request)")
    if int(head["version"]) != VERSION:
        raise ProtocolError(f"protocol version mismatch: request {int(head['version'])}, "
                            f"worker {VERSION}")
    kind = int(head["kind"])
    if kind not in (KIND_ROUND, KIND_STATS):
        raise ProtocolError(f"unknown request kind {kind}")
    got = head["fingerprint"].tobytes().ljust(16, b"\0")
    if fingerprint is not None and got != fingerprint:
        raise ProtocolError(f"identity mismatch: request fingerprint {got.hex()}, worker "
                            f"{fingerprint.hex()} (a client built for another target, "
                            "tokenizer or drafter)")
    n = int(head["n_entries"])
    if n > max_entries:
        raise ProtocolError(f"{n} entries exceed the limit of {max_entries}")
    entries, off, seen = [], REQUEST_HEADER.itemsize, set()
    for i in range(n):
        if off + ENTRY.itemsize > len(buf):
            raise ProtocolError(f"entry {i} is truncated")
        rid, seed, length, temperature, n_tokens, n_rows, feature, k, op, flags, code = \
            ENTRY_FIELDS.unpack_from(buf, off)
        off += ENTRY.itemsize
        if code not in ROW_BYTES or (n_rows and code == ROW_NONE):
            raise ProtocolError(f"entry {i}: unknown row dtype code {code}")
        size = 4 * n_tokens + n_rows * feature * ROW_BYTES[code]
        if size > max_bytes_per_entry:
            raise ProtocolError(f"entry {i}: {size} bytes exceed the per-entry limit")
        if off + size > len(buf):
            raise ProtocolError(f"entry {i}: {size} bytes of tokens and rows announced, "
                                f"{len(buf) - off} left")
        if rid in seen:
            raise ProtocolError(f"request id {rid} appears twice in one round")
        seen.add(rid)
        # tokens and rows as sent, views of the message (a history copies what it keeps)
        tokens = np.frombuffer(buf, np.int32, n_tokens, off)
        off += 4 * n_tokens
        rows = np.frombuffer(buf, ROW_CODE_DTYPES[code], n_rows * feature, off).reshape(n_rows, feature) \
            if n_rows else None
        off += n_rows * feature * ROW_BYTES[code]
        entries.append(Entry(rid, op, tokens, rows, k, temperature, seed, bool(flags & FLAG_WANT_PROBS),
                             feature, length))
    if off != len(buf):
        raise ProtocolError(f"{len(buf) - off} trailing bytes after {n} entries")
    return Request(kind, int(head["client_id"]), entries)


# -- replies -------------------------------------------------------------------------------
def encode_reply(replies: list[Reply], vocab: int) -> bytes:
    head = np.zeros((), REPLY_HEADER)
    head["magic"], head["version"], head["kind"] = REPLY_MAGIC, VERSION, KIND_ROUND
    head["n_entries"], head["vocab"] = len(replies), vocab
    parts = [head.tobytes()]
    for r in replies:
        tokens = np.ascontiguousarray(r.tokens, np.int32).reshape(-1)
        message = r.message.encode()[:MAX_MESSAGE_BYTES]
        parts += [REPLY_FIELDS.pack(r.request_id, min(r.latency_us, 2**32 - 1), len(tokens), r.status,
                                    r.cache, r.probs is not None, len(message)), tokens.tobytes()]
        if r.probs is not None:
            parts.append(np.ascontiguousarray(r.probs[:len(tokens)], np.float32).tobytes())
        parts.append(message)
    return b"".join(parts)


def ids_in_vocab(tokens: np.ndarray, vocab: int) -> bool:
    """Every int32 token id in [0, vocab): one pass (a negative id, seen unsigned, is huge)."""
    return not len(tokens) or int(np.ascontiguousarray(tokens, np.int32).view(np.uint32).max()) < vocab


def reply_entry_bytes(k: int, vocab: int = 0) -> int:
    """The most bytes one reply entry with up to k drafts takes: probabilities over `vocab`
    tokens (0: none asked for) and its status message at its longest. The client budgets
    rounds with it; the worker checks it before drafting."""
    return REPLY_ENTRY.itemsize + 4 * k + 4 * k * vocab + MAX_MESSAGE_BYTES


def parse_reply(buf: bytes, max_vocab: int = 1 << 22) -> list[Reply]:
    """The client validates replies as strictly as the worker validates requests."""
    if len(buf) < REPLY_HEADER.itemsize:
        raise ProtocolError(f"reply of {len(buf)} bytes is shorter than its header")
    head = np.frombuffer(buf, REPLY_HEADER, 1)[0]
    if bytes(head["magic"]) != REPLY_MAGIC or int(head["version"]) != VERSION:
        raise ProtocolError("not a drafter reply of protocol version %d" % VERSION)
    vocab, off, out = int(head["vocab"]), REPLY_HEADER.itemsize, []
    if vocab > max_vocab:
        raise ProtocolError(f"reply vocabulary {vocab} is implausible")
    for i in range(int(head["n_entries"])):
        if off + REPLY_ENTRY.itemsize > len(buf):
            raise ProtocolError(f"reply entry {i} is truncated")
        rid, latency_us, n, status, cache, has_probs, msg_len = REPLY_FIELDS.unpack_from(buf, off)
        off += REPLY_ENTRY.itemsize
        size = 4 * n + (4 * n * vocab if has_probs else 0) + msg_len
        if off + size > len(buf):
            raise ProtocolError(f"reply entry {i} announces {size} bytes, {len(buf) - off} left")
        tokens = np.frombuffer(buf, np.int32, n, off).copy()
        off += 4 * n
        probs = None
        if has_probs:
            probs = np.frombuffer(buf, np.float32, n * vocab, off).reshape(n, vocab).copy()
            off += 4 * n * vocab
        message = bytes(buf[off:off + msg_len]).decode(errors="replace") if msg_len else ""
        off += msg_len
        if status >= len(STATUS_NAMES):
            raise ProtocolError(f"reply entry {i}: unknown status {status}")
        out.append(Reply(rid, status, tokens, probs, cache, latency_us, message))
    if off != len(buf):
        raise ProtocolError(f"{len(buf) - off} trailing bytes in a reply")
    return out


def encode_stats_reply(stats: dict) -> bytes:
    head = np.zeros((), REPLY_HEADER)
    head["magic"], head["version"], head["kind"] = REPLY_MAGIC, VERSION, KIND_STATS
    return head.tobytes() + json.dumps(stats).encode()


def parse_stats_reply(buf: bytes) -> dict:
    head = np.frombuffer(buf, REPLY_HEADER, 1)[0] if len(buf) >= REPLY_HEADER.itemsize else None
    if head is None or bytes(head["magic"]) != REPLY_MAGIC or int(head["kind"]) != KIND_STATS:
        raise ProtocolError("not a drafter stats reply")
    try:
        return decode_json(buf[REPLY_HEADER.itemsize:], "drafter stats reply")  # size and depth bounded
    except WireError as exc:
        raise ProtocolError(str(exc)) from None


def entry_bytes(e: Entry, row_dtype: str) -> int:
    """Bytes `e` takes in a request (its header, tokens and rows)."""
    rows = 0 if e.rows is None else e.rows.size * ROW_BYTES[ROW_DTYPES[row_dtype]]
    return ENTRY.itemsize + 4 * len(e.tokens) + rows


def round_bytes_per_token(feature: int, row_dtype: str) -> int:
    """Request bytes one committed token costs on the wire (its id and its hidden row)."""
    return 4 + feature * ROW_BYTES[ROW_DTYPES[row_dtype]]
