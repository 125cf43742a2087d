"""Copy scattered ranges of a local array into one contiguous destination (shm reads)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def gather_into(src: np.ndarray, offsets: np.ndarray, lengths, dest: np.ndarray) -> None:
    """dest = concat(src[o:o+n] for each range). Ranges must already be bounds-checked."""
    if isinstance(lengths, int | np.integer):
        n = int(lengths)
        if len(offsets) == 1:
            dest[:n] = src[int(offsets[0]):int(offsets[0]) + n]
            return
        # A (len-n+1, n) view whose row i starts at byte i: fancy indexing then copies
        # each row with one strided copy, no index array of n entries per row.
        rows = as_strided(src, shape=(len(src) - n + 1, n), strides=(1, 1), writeable=False)
        dest[: len(offsets) * n].reshape(len(offsets), n)[:] = rows[offsets.astype(np.intp)]
        return
    pos = 0
    for o, n in zip(offsets.tolist(), lengths.tolist(), strict=False):
        dest[pos:pos + n] = src[o:o + n]
        pos += n
