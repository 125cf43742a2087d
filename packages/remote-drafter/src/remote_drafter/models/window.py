"""Each request's context rows kept on the drafter's device (shared by the drafters that
read hidden rows): a ring of the last `window` rows per request, brought up to date with
only the rows committed since its last round. A drafter may store the rows as they come
(the Llama-style DSpark stand-in) or encoded (DeepSeek-V4.1's drafter keeps each layer's
key/value rows, computed once per position).

A round's work does not grow with its request count in launches: every request's ring is
one slot of one tensor per device, the new rows of the whole batch are encoded in one call
and written with one indexed copy, and the batch's context is read with one gather."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from remote_drafter.engine.history import History

from .staging import RowStage, to_device

# (the round's new rows [k, feature] on the device, as the histories keep them; their
# positions [k] on the device) -> rows [k, width]
Encode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _as_rows(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return rows


class DeviceWindows(dict):
    """device -> RingPool: rings keyed by the history's lineage, which the service's
    snapshots share with the session's history and which a reset or re-open replaces (so
    stale rows are never served); held weakly, so a ring goes when its request is released
    or expires, and its slot is reused."""

    def __init__(self, window: int, width: int, encode: Encode = _as_rows,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.window, self.width, self.encode, self.dtype = window, width, encode, dtype

    def lay_out(self, histories: list[History], device) -> tuple[torch.Tensor, np.ndarray]:
        """Every history's last rows, brought up to date: (ctx [B, window, width] on `device`,
        each request's rows oldest first and right-aligned; m [B], how many are valid). The
        rows before a request's last m are finite (zeros, or older rows of its own) and
        mean nothing: a caller masks them."""
        pool = self.get(str(device))
        if pool is None:
            pool = self[str(device)] = RingPool(self.window, self.width, device, self.dtype)
        at: dict[int, int] = {}  # lineage -> rows_added of its history in this batch
        for i, h in enumerate(histories):
            if at.setdefault(id(h.lineage), h.rows_added) != h.rows_added:
                # two snapshots of one sequence at different points: each needs the ring as
                # it was for it, so the batch goes in two parts, the first laid out first
                (a, m), (b, n) = self.lay_out(histories[:i], device), self.lay_out(histories[i:], device)
                return torch.cat([a, b]), np.concatenate([m, n])
        rings, rows, positions, writes = [], [], [], []
        for h in histories:
            ring, where = pool.ring(h)
            if len(where):  # the newest row is of position length - 2 (its token's row comes later)
                k = len(where)
                rows.append(h.newest_rows(k))
                positions.append(np.arange(h.length - 1 - k, h.length - 1))
                writes.append(where)
            rings.append(ring)
        if rows:
            new = self.encode(pool.rows.to_device(rows), to_device(np.concatenate(positions), pool.device))
            pool.write(np.concatenate(writes), new.to(self.dtype))
        return pool.gather(rings), np.array([r.m for r in rings], np.int64)


class RowRing:
    """One request's rows: slot `slot` of its pool, `head` where the next row goes, the
    newest `m` rows valid, `seen` the history's rows_added they reflect."""

    def __init__(self, slot: int):
        self.slot, self.head, self.m, self.seen = slot, 0, 0, 0


class RingPool:
    """One device's rings as slots of one tensor [capacity, window, width]. Memory: window x
    width values per slot; the capacity doubles to the most requests drafted at once and
    stays there (a released request's slot is reused)."""

    def __init__(self, window: int, width: int, device, dtype: torch.dtype):
        self.window, self.width, self.device, self.dtype = window, width, torch.device(device), dtype
        self.store = zeros((4, window, width), self.device, dtype)
        self.rows = RowStage(self.device)  # a round's new rows on their way here
        self.free = list(range(4))
        self.rings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def ring(self, h: History) -> tuple[RowRing, np.ndarray]:
        """h's ring (a fresh one for a new lineage, an older snapshot, or more new rows
        than kept), advanced past the newest rows it lacks (at most a window): and the flat
        store rows those go to, oldest first (the caller writes them)."""
        ring, kept, n = self.rings.get(h.lineage), h.row_count, self.window
        new = -1 if ring is None else h.rows_added - ring.seen
        if not 0 <= new <= kept:
            ring = self.rings[h.lineage] = RowRing(self._take_slot())
            weakref.finalize(ring, self._give_back, ring.slot)
            new = kept
        k = min(new, n)
        where = ring.slot * n + (ring.head + np.arange(k)) % n
        ring.head, ring.seen = (ring.head + k) % n, h.rows_added
        ring.m = min(n, ring.m + k, kept)  # a history may keep fewer rows than the window
        return ring, where

    def _take_slot(self) -> int:
        if not self.free:
            n = len(self.store)
            grown = zeros((2 * n, self.window, self.width), self.device, self.dtype)
            grown[:n] = self.store
            self.store = grown
            self.free.extend(range(n, 2 * n))  # in place: a finalizer may append from another thread
        slot = self.free.pop()
        self.store[slot] = 0  # a reused slot's old rows never reach another request
        return slot

    def _give_back(self, slot: int) -> None:
        self.free.append(slot)

    def __len__(self) -> int:
        """Rings held: one per request drafted and not yet released."""
        return len(self.rings)

    def write(self, where: np.ndarray, rows: torch.Tensor) -> None:
        flat = self.store.view(-1, self.width)
        flat.index_copy_(0, to_device(where, self.device), rows)

    def gather(self, rings: list[RowRing]) -> torch.Tensor:
        """[B, window, width]: each ring's rows oldest first (its valid ones at the end)."""
        n = self.window
        slots, heads = (np.array([(r.slot, r.head) for r in rings], np.int64).reshape(-1, 2)).T
        where = slots[:, None] * n + (heads[:, None] + np.arange(n)) % n
        return self.store.view(-1, self.width)[to_device(where, self.device)]


def zeros(shape: tuple, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros on `device`; float32 on the CPU in numpy's memory (huge pages for arrays this
    large, where torch's allocator maps 4 KB ones)."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        return torch.from_numpy(np.zeros(shape, np.float32))
    return torch.zeros(shape, dtype=dtype, device=device)
