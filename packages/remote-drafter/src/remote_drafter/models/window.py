"""Each request's context rows kept on the drafter's device (shared by the drafters that
read hidden rows): a ring of the last `window` rows per request, brought up to date with
only the rows committed since its last round. A drafter may store the rows as they come
(the Llama-style DSpark stand-in) or encoded (DeepSeek-V4.1's drafter keeps each layer's
key/value rows, computed once per position)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from remote_drafter.engine.history import History

# (new rows float32 [k, feature] on the host, their positions [k], device) -> rows [k, width]
Encode = Callable[[np.ndarray, np.ndarray, torch.device], torch.Tensor]


def _as_rows(rows: np.ndarray, positions: np.ndarray, device) -> torch.Tensor:
    return torch.tensor(rows)  # a host copy of the new rows (they are read-only)


class DeviceWindows(dict):
    """device -> {lineage: RowRing}: rings keyed by the history's lineage, which the
    service's snapshots share with the session's history and which a reset or re-open
    replaces (so stale rows are never served); held weakly, so a ring goes when its request
    is released or expires."""

    def __init__(self, window: int, width: int, encode: Encode = _as_rows,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.window, self.width, self.encode, self.dtype = window, width, encode, dtype

    def current(self, h: History, device) -> RowRing:
        """h's last rows on `device`, brought up to date."""
        rings = self.setdefault(str(device), weakref.WeakKeyDictionary())
        ring, rows = rings.get(h.lineage), h.rows
        new = -1 if ring is None else h.rows_added - ring.seen
        if not 0 <= new <= len(rows):  # new, an older snapshot, or more new rows than kept
            ring = rings[h.lineage] = RowRing(empty((self.window, self.width), device, self.dtype))
            new = len(rows)
        k = min(new, self.window)
        # the newest row is of position length - 2 (the newest token's row comes later)
        positions = np.arange(h.length - 1 - k, h.length - 1)
        ring.push(self.encode(rows[len(rows) - k:], positions, device) if k else None, h.rows_added)
        ring.m = min(ring.m, len(rows))  # a history keeping fewer rows than the window
        return ring


def empty(shape: tuple, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised on `device`. Float32 on the CPU in numpy's memory: numpy maps arrays
    this large on huge pages, where torch's allocator maps each one afresh in 4 KB pages,
    faulted in again on every round, which slows a CPU round's host part."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        return torch.from_numpy(np.empty(shape, np.float32))
    return torch.empty(shape, dtype=dtype, device=device)


class RowRing:
    """One request's last `window` rows on a device, as a ring: `head` is where the next
    row goes, the newest `m` rows are valid, `seen` is the history's rows_added they
    reflect. Memory: window x width values per open request."""

    def __init__(self, ring: torch.Tensor):
        self.ring, self.head, self.m, self.seen = ring, 0, 0, 0

    def push(self, rows: torch.Tensor | None, seen: int) -> None:
        n = len(self.ring)
        if rows is not None:
            k = len(rows)
            a = min(k, n - self.head)
            self.ring[self.head:self.head + a] = rows[:a]
            self.ring[:k - a] = rows[a:]
            self.head, self.m = (self.head + k) % n, min(n, self.m + k)
        self.seen = seen

    def lay_out(self, dst: torch.Tensor) -> int:
        """Copy the valid rows, oldest first, to the end of dst [window, width] and zero
        the rest (a full window, the usual case, has none); their count."""
        n, m = len(self.ring), self.m
        first = (self.head - m) % n
        a = min(m, n - first)  # rows before the ring wraps
        dst[:n - m] = 0
        # One cat, not two copies: one kernel on a GPU, memcpy speed on the CPU (copy_ ran
        # at half that there).
        torch.cat([self.ring[first:first + a], self.ring[:m - a]], out=dst[n - m:])
        return m
