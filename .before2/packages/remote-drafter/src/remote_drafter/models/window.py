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

from .staging import RowStage, to_device_all

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
        mean nothing: a caller masks them. A drafter that has small arrays of its own to
        send plans the round instead (`plan`), so they travel in the same copy."""
        plan = self.plan(histories, device)
        plan.send()
        return plan.context(), plan.kept

    def plan(self, histories: list[History], device) -> WindowPlan:
        """The round's layout worked out on the host, the rings advanced: what its `send`
        copies to the device and its `context` then builds there."""
        pool = self.get(str(device))
        if pool is None:
            pool = self[str(device)] = RingPool(self.window, self.width, device, self.dtype)
        return WindowPlan(self, pool, self._parts(pool, histories))

    def _parts(self, pool: RingPool, histories: list[History]) -> list[Part]:
        at: dict[int, int] = {}  # lineage -> rows_added of its history in this batch
        for i, h in enumerate(histories):
            if at.setdefault(id(h.lineage), h.rows_added) != h.rows_added:
                # two snapshots of one sequence at different points: each needs the ring as
                # it was for it, so the batch goes in two parts, the first laid out first
                return self._parts(pool, histories[:i]) + self._parts(pool, histories[i:])
        part, rings = Part(), []
        for h in histories:
            ring, where = pool.ring(h)
            if len(where):  # the newest row is of position length - 2 (its token's row comes later)
                k = len(where)
                part.rows.append(h.newest_rows(k))
                part.positions.append(np.arange(h.length - 1 - k, h.length - 1))
                part.writes.append(where)
            rings.append(ring)
        part.kept = np.array([r.m for r in rings], np.int64)
        # the plan holds its rings until its context is read: a ring dropped sooner (a later
        # part's fresh ring replacing it) would give its slot to another request, zeroed
        # before this part's rows were read
        part.rings, part.read = rings, pool.read_rows(rings)
        return [part]


class Part:
    """A run of a round's requests with no lineage twice at different points: its new rows
    (host), their positions and store rows, its rings and the store rows its context is read
    from."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.positions: list[np.ndarray] = []
        self.writes: list[np.ndarray] = []
        self.rings: list[RowRing] = []
        self.kept = self.read = np.zeros(0, np.int64)

    def indices(self) -> list[np.ndarray]:
        """[positions, writes, read]: what `WindowPlan.send` copies for this part."""
        if not self.rows:
            return [np.zeros(0, np.int64), np.zeros(0, np.int64), self.read]
        return [np.concatenate(self.positions), np.concatenate(self.writes), self.read]


class WindowPlan:
    """One round's windows: `send` copies the round's small arrays (the parts' indices and
    the caller's own, int64) to the device in one queued copy, then `context` encodes the new
    rows, writes them into the rings and reads the batch's context, in launches that do not
    grow with the request count."""

    def __init__(self, windows: DeviceWindows, pool: RingPool, parts: list[Part]):
        self.windows, self.pool, self.parts = windows, pool, parts
        self.kept = np.concatenate([p.kept for p in parts])
        self._indices: list[torch.Tensor] | None = None

    def send(self, *own: np.ndarray) -> list[torch.Tensor]:
        """Copies the plan's indices and `own` arrays; returns `own` on the device."""
        indices = [a for p in self.parts for a in p.indices()]
        sent = to_device_all([*indices, *own], self.pool.device)
        self._indices = sent[:len(indices)]
        return sent[len(indices):]

    def context(self) -> torch.Tensor:
        """[B, window, width] on the device (after `send`)."""
        out = []
        for i, part in enumerate(self.parts):
            positions, writes, read = self._indices[3 * i:3 * i + 3]
            if part.rows:
                new = self.windows.encode(self.pool.rows.to_device(part.rows), positions)
                self.pool.write(writes, new.to(self.windows.dtype))
            out.append(self.pool.gather(read))
        return out[0] if len(out) == 1 else torch.cat(out)


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

    def write(self, where: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [k, width] into the flat store rows `where` [k] (on the device)."""
        self.store.view(-1, self.width).index_copy_(0, where, rows)

    def read_rows(self, rings: list[RowRing]) -> np.ndarray:
        """[B, window]: the flat store rows of each ring's rows, oldest first (its valid ones
        at the end)."""
        n = self.window
        slots, heads = (np.array([(r.slot, r.head) for r in rings], np.int64).reshape(-1, 2)).T
        return slots[:, None] * n + (heads[:, None] + np.arange(n)) % n

    def gather(self, where: torch.Tensor) -> torch.Tensor:
        """[B, window, width]: the store rows `where` [B, window] (on the device)."""
        return self.store.view(-1, self.width)[where]


def zeros(shape: tuple, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros on `device`; float32 on the CPU in numpy's memory (huge pages for arrays this
    large, where torch's allocator maps 4 KB ones)."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        return torch.from_numpy(np.zeros(shape, np.float32))
    return torch.zeros(shape, dtype=dtype, device=device)
