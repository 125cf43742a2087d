"""The shard file (TensorFold recipe format): engram-l{L}-r{rank}of{N}.bin.

A 4,096-byte header whose first 48 bytes are six little-endian u64 - magic 0x31344E4531565344,
layer, lo, hi, total_rows, row_bytes (264) - then rows lo..hi-1 back to back: global row r
sits at byte 4096 + (r - lo) * 264. Rank r owns a contiguous run of (order, head) columns,
hence a contiguous row range.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from ofl.gather import gather_into

from .geometry import ROW_BYTES

# The u64 of the format named "DSV41EN1" (ARCHITECTURE.md § Shard format); little-endian on
# disk its bytes read "DSV1EN41".
MAGIC = 0x31344E4531565344
HEADER_BYTES = 4096
HEADER = struct.Struct("<6Q")


def shard_name(layer: int, rank: int, nranks: int = 2) -> str:
    return f"engram-l{layer}-r{rank}of{nranks}.bin"


@dataclass(frozen=True)
class ShardHeader:
    layer: int
    lo: int
    hi: int
    total_rows: int
    row_bytes: int = ROW_BYTES

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.rows * self.row_bytes

    def pack(self) -> bytes:
        head = HEADER.pack(MAGIC, self.layer, self.lo, self.hi, self.total_rows, self.row_bytes)
        return head + bytes(HEADER_BYTES - len(head))

    @classmethod
    def unpack(cls, raw: bytes, where: str = "shard") -> ShardHeader:
        if len(raw) < HEADER.size:
            raise ValueError(f"{where}: shorter than a shard header")
        magic, layer, lo, hi, total, row_bytes = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ValueError(f"{where}: not an Engram shard (magic 0x{magic:016x})")
        if row_bytes != ROW_BYTES or not lo <= hi <= total:
            raise ValueError(f"{where}: bad header (lo={lo} hi={hi} total={total} "
                             f"row_bytes={row_bytes})")
        return cls(layer, lo, hi, total, row_bytes)


class ShardReader:
    """Memory-mapped shard: zero-copy row views, batched row reads, a content digest."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self.header = ShardHeader.unpack(f.read(HEADER.size), self.path)
        size = os.path.getsize(self.path)
        if size != self.header.file_bytes:
            raise ValueError(f"{self.path}: {size} bytes, header says {self.header.file_bytes}")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.table = np.frombuffer(self._mm, np.uint8, count=self.header.rows * ROW_BYTES,
                                   offset=HEADER_BYTES).reshape(self.header.rows, ROW_BYTES)

    @property
    def layer(self) -> int:
        return self.header.layer

    @property
    def lo(self) -> int:
        return self.header.lo

    @property
    def hi(self) -> int:
        return self.header.hi

    def check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < self.lo or ids.max() >= self.hi):
            raise ValueError(f"{self.path}: row ids must lie in [{self.lo}, {self.hi}) "
                             f"(got {ids.min()}..{ids.max()})")

    def row(self, row_id: int) -> np.ndarray:
        """A zero-copy [264] view of global row `row_id`."""
        self.check_ids(np.array([row_id]))
        return self.table[row_id - self.lo]

    def rows(self, ids) -> np.ndarray:
        """Copies of global rows `ids` as [n, 264] uint8 (ofl's prefetching gather)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.check_ids(ids)
        out = np.empty((len(ids), ROW_BYTES), np.uint8)
        gather_into(self.table.reshape(-1), (ids - self.lo).astype(np.uint64) * ROW_BYTES,
                    ROW_BYTES, out.reshape(-1))
        return out

    def digest(self, samples: int = 4096, chunk_rows: int = 64) -> str:
        """blake2b of the header and `samples` evenly spaced runs of rows (all rows when the
        shard is smaller): cheap at start-up even for 94 GiB, and tables that differ
        anywhere but in unsampled rows differ here. `qualify` compares every byte."""
        h = hashlib.blake2b(digest_size=16)
        h.update(self.header.pack())
        n = self.header.rows
        if n <= samples * chunk_rows:
            h.update(memoryview(self.table).cast("B"))
        else:
            for start in np.linspace(0, n - chunk_rows, samples, dtype=np.int64).tolist():
                h.update(memoryview(self.table[start:start + chunk_rows]).cast("B"))
        return h.hexdigest()

    def close(self) -> None:
        self.table = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a row view

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardWriter:
    """Writes a shard: the header, then rows in order or at given positions (sparse files
    work: the file is sized up front, unwritten rows read as zeros)."""

    def __init__(self, path: str | os.PathLike, header: ShardHeader):
        self.path = os.fspath(path)
        self.header = header
        self._f = open(self.path, "w+b")
        self._f.write(header.pack())
        self._f.truncate(header.file_bytes)

    def write_rows(self, first_row: int, rows: np.ndarray) -> None:
        """Write [n, 264] uint8 rows starting at global row `first_row`."""
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        if rows.ndim != 2 or rows.shape[1] != ROW_BYTES:
            raise ValueError(f"rows must be [n, {ROW_BYTES}] uint8, got {rows.shape}")
        if first_row < self.header.lo or first_row + len(rows) > self.header.hi:
            raise ValueError(f"rows [{first_row}, {first_row + len(rows)}) fall outside the "
                             f"shard's [{self.header.lo}, {self.header.hi})")
        self._f.seek(HEADER_BYTES + (first_row - self.header.lo) * ROW_BYTES)
        self._f.write(memoryview(rows).cast("B"))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
