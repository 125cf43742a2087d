"""The drafter wire protocol (version 2), carried as ofl messages (where a round sits in a
step: ARCHITECTURE.md § Drafting data path). Torch-free. One request holds one entry per
running request of the engine, so a step costs one round trip and the worker drafts a batch:

    RequestHeader (40 B): magic "DRQ1", version u16, kind u16, fingerprint 16 B,
                          n_entries u32, client_id u32, feature u32, row_dtype u8, pad 3 B
    Entry (40 B) x n_entries, then every entry's tokens int32[n_tokens], then every
    entry's rows [n_rows x feature] (row_dtype), each block in entry order
    ReplyHeader (16 B): magic "DRP1", version u16, kind u16, n_entries u32, vocab u32
    ReplyEntry (24 B) x n_entries, then every entry's tokens int32[n_drafts], then the
    probabilities float32[n_drafts x vocab] of those with has_probs, then the status
    messages utf-8[msg_len]

The entries are one table and their tokens and rows one block each, so a round is parsed
and checked (ids in range, rows finite) in a few array operations, not per entry.

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

VERSION = 2
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
                           ("fingerprint", "S16"), ("n_entries", "<u4"), ("client_id", "<u4"),
                           ("feature", "<u4"), ("row_dtype", "u1"), ("pad", "u1", (3,))])
ENTRY = np.dtype([("request_id", "<u8"), ("seed", "<u8"), ("length", "<u8"), ("temperature", "<f4"),
                  ("n_tokens", "<u4"), ("n_rows", "<u4"), ("k", "<u2"), ("op", "u1"), ("flags", "u1")])
REPLY_HEADER = np.dtype([("magic", "S4"), ("version", "<u2"), ("kind", "<u2"),
                         ("n_entries", "<u4"), ("vocab", "<u4")])
REPLY_ENTRY = np.dtype([("request_id", "<u8"), ("latency_us", "<u4"), ("n_drafts", "<u2"),
                        ("status", "u1"), ("cache", "u1"), ("has_probs", "u1"), ("pad", "u1"),
                        ("msg_len", "<u2"), ("pad2", "u1", (4,))])


def _fields(dtype: np.dtype) -> struct.Struct:
    """`dtype`'s layout as struct packs it (fields named pad* as padding): a header or an
    entry packed or read field by field in Python, without numpy's scalars."""
    codes = {("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q", ("f", 4): "f"}
    offsets = [dtype.fields[name][1] for name in dtype.names]
    assert offsets == sorted(offsets) and all(dtype.fields[name][0].byteorder in "<|=" for name in dtype.names), \
        f"{dtype}: fields in offset order, little-endian"
    fmt = "<" + "".join(f"{dtype.fields[name][0].itemsize}x" if name.startswith("pad") else
                        f"{dtype.fields[name][0].itemsize}s" if dtype.fields[name][0].kind == "S" else
                        codes[dtype.fields[name][0].kind, dtype.fields[name][0].itemsize]
                        for name in dtype.names)
    packer = struct.Struct(fmt)
    assert packer.size == dtype.itemsize, f"{dtype} packs to {packer.size} bytes"
    return packer


REQUEST_HEADER_FIELDS, ENTRY_FIELDS = _fields(REQUEST_HEADER), _fields(ENTRY)
REPLY_HEADER_FIELDS, REPLY_FIELDS = _fields(REPLY_HEADER), _fields(REPLY_ENTRY)
assert (REQUEST_HEADER.itemsize, ENTRY.itemsize, REPLY_HEADER.itemsize, REPLY_ENTRY.itemsize) == (40, 40, 16, 24)


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
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))  # every entry's, in order
    rows: np.ndarray | None = None  # every entry's, in order ([n, feature]; None: no entry sent rows)


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
    are cast once. Every entry's rows are of one width (one engine's taps)."""
    tokens = [np.ascontiguousarray(e.tokens, np.int32).reshape(-1) for e in entries]
    rows = [e.rows if e.rows is not None and len(e.rows) else None for e in entries]
    widths = {r.shape[1] for r in rows if r is not None}
    if len(widths) > 1:
        raise ValueError(f"one request carries rows of one width, these are {sorted(widths)} wide")
    feature = widths.pop() if widths else 0
    try:
        head = REQUEST_HEADER_FIELDS.pack(REQUEST_MAGIC, VERSION, kind, fingerprint, len(entries), client_id,
                                          feature, ROW_DTYPES[row_dtype] if feature else ROW_NONE)
    except struct.error as exc:
        raise ValueError(f"request header out of range (client id {client_id}, {len(entries)} entries): {exc}") from None
    table = b"".join(ENTRY_FIELDS.pack(e.request_id, e.seed, e.length, e.temperature, len(t),
                                       0 if r is None else len(r), e.k, e.op,
                                       FLAG_WANT_PROBS if e.want_probs else 0)
                     for e, t, r in zip(entries, tokens, rows))
    dtype = rows_module.DTYPES[row_dtype]
    # the tokens, a few a request, joined into one part (a part costs more than a small
    # copy); the rows, large, each sent from where it lies
    return [head, table, np.concatenate(tokens).view(np.uint8) if tokens else b"",
            *(np.ascontiguousarray(rows_module.cast(r, dtype)).reshape(-1).view(np.uint8)
              for r in rows if r is not None)]


def parse_request(buf: bytes, fingerprint: bytes | None, max_entries: int = 4096,
                  max_bytes_per_entry: int = 64 << 20) -> Request:
    """A request; ProtocolError when the message as a whole is unusable. Its entries'
    tokens and rows are views of `buf` (a history copies what it keeps)."""
    size, off = len(buf), REQUEST_HEADER.itemsize
    if size < off:
        raise ProtocolError(f"request of {size} bytes is shorter than its header")
    magic, version, kind, got, n, client_id, feature, code = REQUEST_HEADER_FIELDS.unpack_from(buf)
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"bad magic {magic!r} (not a drafter request)")
    if version != VERSION:
        raise ProtocolError(f"protocol version mismatch: request {version}, worker {VERSION}")
    if kind not in (KIND_ROUND, KIND_STATS):
        raise ProtocolError(f"unknown request kind {kind}")
    if fingerprint is not None and got != fingerprint:
        raise ProtocolError(f"identity mismatch: request fingerprint {got.hex()}, worker "
                            f"{fingerprint.hex()} (a client built for another target, "
                            "tokenizer or drafter)")
    if n > max_entries:
        raise ProtocolError(f"{n} entries exceed the limit of {max_entries}")
    if code not in ROW_BYTES:
        raise ProtocolError(f"unknown row dtype code {code}")
    if off + n * ENTRY.itemsize > size:
        raise ProtocolError(f"{n} entries announced, the message is truncated within them")
    table = list(ENTRY_FIELDS.iter_unpack(memoryview(buf)[off:off + n * ENTRY.itemsize]))
    off += n * ENTRY.itemsize
    row_bytes = feature * ROW_BYTES[code]
    all_tokens = all_rows = 0
    for i, (_, _, _, _, n_tokens, n_rows, _, _, _) in enumerate(table):
        if n_rows and not 0 < row_bytes <= max_bytes_per_entry:
            raise ProtocolError(f"rows of {feature} x {ROW_BYTES[code]} bytes (row dtype code {code}) announced")
        if (entry_size := 4 * n_tokens + n_rows * row_bytes) > max_bytes_per_entry:
            raise ProtocolError(f"entry {i}: {entry_size} bytes exceed the per-entry limit")
        all_tokens, all_rows = all_tokens + n_tokens, all_rows + n_rows
    if (end := off + 4 * all_tokens + all_rows * row_bytes) != size:
        raise ProtocolError(f"entries announced {end - off} bytes of tokens and rows, {size - off} follow"
                            if end > size else f"{size - end} trailing bytes after {n} entries")
    if len({e[0] for e in table}) != n:
        seen = set()
        twice = next(e[0] for e in table if e[0] in seen or seen.add(e[0]))
        raise ProtocolError(f"request id {twice} appears twice in one round")
    tokens = np.frombuffer(buf, np.int32, all_tokens, off)
    rows = np.frombuffer(buf, ROW_CODE_DTYPES[code], all_rows * feature, off + 4 * all_tokens).reshape(
        all_rows, feature) if all_rows else None
    entries, t, r = [], 0, 0
    for rid, seed, length, temperature, n_tokens, n_rows, k, op, flags in table:
        entries.append(Entry(rid, op, tokens[t:t + n_tokens], rows[r:r + n_rows] if n_rows else None, k,
                             temperature, seed, bool(flags & FLAG_WANT_PROBS), feature, length))
        t, r = t + n_tokens, r + n_rows
    return Request(kind, client_id, entries, tokens, rows)


# -- replies -------------------------------------------------------------------------------
def encode_reply(replies: list[Reply], vocab: int) -> bytes:
    tokens = [np.ascontiguousarray(r.tokens, np.int32).reshape(-1) for r in replies]
    messages = [r.message.encode()[:MAX_MESSAGE_BYTES] if r.message else b"" for r in replies]
    table = b"".join(REPLY_FIELDS.pack(r.request_id, min(r.latency_us, 2**32 - 1), len(t), r.status,
                                       r.cache, r.probs is not None, len(m))
                     for r, t, m in zip(replies, tokens, messages))
    probs = [np.ascontiguousarray(r.probs[:len(t)], np.float32).tobytes()
             for r, t in zip(replies, tokens) if r.probs is not None]
    return b"".join([REPLY_HEADER_FIELDS.pack(REPLY_MAGIC, VERSION, KIND_ROUND, len(replies), vocab), table,
                     np.concatenate(tokens).tobytes() if tokens else b"", *probs, *messages])


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
    size, off = len(buf), REPLY_HEADER.itemsize
    if size < off:
        raise ProtocolError(f"reply of {size} bytes is shorter than its header")
    magic, version, _, n, vocab = REPLY_HEADER_FIELDS.unpack_from(buf)
    if magic != REPLY_MAGIC or version != VERSION:
        raise ProtocolError("not a drafter reply of protocol version %d" % VERSION)
    if vocab > max_vocab:
        raise ProtocolError(f"reply vocabulary {vocab} is implausible")
    if off + n * REPLY_ENTRY.itemsize > size:
        raise ProtocolError(f"{n} reply entries announced, the reply is truncated within them")
    table = list(REPLY_FIELDS.iter_unpack(memoryview(buf)[off:off + n * REPLY_ENTRY.itemsize]))
    off += n * REPLY_ENTRY.itemsize
    all_tokens = prob_rows = messages = 0
    for i, (_, _, n_drafts, status, _, has_probs, msg_len) in enumerate(table):
        if status >= len(STATUS_NAMES):
            raise ProtocolError(f"reply entry {i}: unknown status {status}")
        all_tokens, messages = all_tokens + n_drafts, messages + msg_len
        prob_rows += n_drafts if has_probs else 0
    if (end := off + 4 * all_tokens + 4 * prob_rows * vocab + messages) != size:
        raise ProtocolError(f"reply entries announced {end - off} bytes, {size - off} follow")
    tokens = np.frombuffer(buf, np.int32, all_tokens, off).copy()
    off += 4 * all_tokens
    probs = np.frombuffer(buf, np.float32, prob_rows * vocab, off).reshape(prob_rows, vocab).copy() \
        if prob_rows else np.zeros((0, vocab), np.float32)
    off += 4 * prob_rows * vocab
    out, t, p = [], 0, 0
    for rid, latency_us, n_drafts, status, cache, has_probs, msg_len in table:
        message = bytes(buf[off:off + msg_len]).decode(errors="replace") if msg_len else ""
        off += msg_len
        out.append(Reply(rid, status, tokens[t:t + n_drafts], probs[p:p + n_drafts] if has_probs else None,
                         cache, latency_us, message))
        t, p = t + n_drafts, p + (n_drafts if has_probs else 0)
    return out


def encode_stats_reply(stats: dict) -> bytes:
    return REPLY_HEADER_FIELDS.pack(REPLY_MAGIC, VERSION, KIND_STATS, 0, 0) + json.dumps(stats).encode()


def parse_stats_reply(buf: bytes) -> dict:
    head = REPLY_HEADER_FIELDS.unpack_from(buf) if len(buf) >= REPLY_HEADER.itemsize else None
    if head is None or head[0] != REPLY_MAGIC or head[2] != KIND_STATS:
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
