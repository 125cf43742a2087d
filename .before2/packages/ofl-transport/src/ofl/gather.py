"""Copy scattered ranges of a local array into one contiguous destination (shm reads, the
tcp server's many-row replies, local Engram shards). The compiled loop prefetches rows
ahead; numpy is the fallback where it was not built, with the same bytes."""

from __future__ import annotations

import numpy as np

try:
    from ._gather_cffi import ffi, lib
except ImportError:  # built without a C compiler
    lib = None


def gather_into(src: np.ndarray, offsets: np.ndarray, lengths, dest: np.ndarray) -> None:
    """dest = concat(src[o:o+n] for each range). Ranges must already be bounds-checked."""
    offsets = np.ascontiguousarray(offsets, dtype=np.uint64)
    fixed = isinstance(lengths, int | np.integer)
    if lib is not None and len(src) and dest.flags.c_contiguous:
        d, s, o = ffi.from_buffer(dest), ffi.from_buffer(src), ffi.from_buffer("uint64_t[]", offsets)
        if fixed:
            lib.ofl_gather_rows(d, s, o, len(offsets), int(lengths))
        else:
            lens = np.ascontiguousarray(lengths, dtype=np.uint32)
            lib.ofl_gather_ranges(d, s, o, ffi.from_buffer("uint32_t[]", lens), len(offsets))
        return
    gather_into_numpy(src, offsets, lengths, dest)


def gather_into_numpy(src: np.ndarray, offsets: np.ndarray, lengths, dest: np.ndarray) -> None:
    pos = 0
    if isinstance(lengths, int | np.integer):
        n = int(lengths)
        out = dest[: len(offsets) * n].reshape(len(offsets), n)
        for i, o in enumerate(offsets.tolist()):
            out[i] = src[o:o + n]
        return
    for o, n in zip(offsets.tolist(), lengths.tolist()):
        dest[pos:pos + n] = src[o:o + n]
        pos += n
