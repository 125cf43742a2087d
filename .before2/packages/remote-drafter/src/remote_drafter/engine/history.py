"""A request's bounded history: its newest committed tokens and the target's hidden rows
of all but the newest token (the lag of one: the newest token's row comes from the next
verification pass). Both sides keep one: the worker drafts from it, the client re-opens a
request from it after the worker lost state, so drafts after a re-open equal drafts
without one. Torch-free; not thread-safe (the service changes histories under its lock).

Tokens are a `Tail` and rows `Chunks`: appended in amortised O(new items), and never
rewritten once handed out while anything else still shares them, so a shallow copy is a
snapshot (what the service drafts from outside its lock). `lineage` and `rows_added` let a
drafter keep its own copy of the rows (on its device) and fetch only the rows added since
it last looked (`newest_rows`)."""

from __future__ import annotations

import copy
import sys
import threading

import numpy as np

from ofl.channel import HELD_ONCE  # sys.getrefcount of what one local name holds

from .rows import all_finite, cast


def _read_only_view(array: np.ndarray) -> np.ndarray:
    """A read-only view of `array`, made once per buffer: what is handed out is sliced from
    it (a flag set on every slice costs more than the slice)."""
    view = array.view()
    view.flags.writeable = False
    return view


class Tail:
    """The newest `keep` items of an append-only sequence: a buffer of up to 2 x keep items,
    written past its newest item and moved to the front only when full, so a move costs at
    most one copy per item appended since the last one. Items handed out (`view`) are never
    rewritten while a copy or a view still shares the buffer (a move then takes a fresh
    one); a buffer nothing else holds is moved in place, with no allocation."""

    def __init__(self, keep: int, shape: tuple, dtype: np.dtype):
        self.keep = keep
        self._use(np.empty((0, *shape), dtype))
        self.start = self.end = 0
        self.written = [0]  # the furthest end written in buf, shared by the copies sharing buf

    def _use(self, buf: np.ndarray) -> None:
        self.buf, self.readable = buf, _read_only_view(buf)

    def __copy__(self) -> Tail:
        shared = object.__new__(Tail)
        shared.__dict__ = self.__dict__.copy()
        return shared

    def __deepcopy__(self, memo) -> Tail:
        own = object.__new__(Tail)  # its read-only view remade over its own buffer
        own.__dict__ = copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "readable"}, memo)
        own._use(own.buf)
        return own

    def view(self) -> np.ndarray:
        return self.readable[self.start:self.end]

    def append(self, items: np.ndarray) -> None:
        k, n, buf = len(items), self.keep, self.buf
        if self.written[0] == self.end and self.end + k <= len(buf):  # the tail past our end is ours
            buf[self.end:self.end + k] = items
            self.end += k
            self.start = max(self.start, self.end - n)
            self.written[0] = self.end
            return
        kept = min(self.end - self.start, max(n - k, 0))
        items = items[max(k - n, 0):]
        size = min(2 * n, 2 * (kept + len(items)))
        # held by self.buf, `buf` and the read-only view alone: nothing handed out shares it
        if len(buf) < size or sys.getrefcount(buf) > HELD_ONCE + 2:
            buf, self.written = np.empty((size, *buf.shape[1:]), buf.dtype), [0]
        buf[:kept] = self.buf[self.end - kept:self.end]  # overlapping in place: numpy copies safely
        buf[kept:kept + len(items)] = items
        if buf is not self.buf:
            self._use(buf)
        self.start, self.end = 0, kept + len(items)
        self.written[0] = self.end


class BlockPool:
    """Row blocks the histories of this process wrote through and no longer write (rows that
    left a window, a released or re-opened request's), kept for the next history that needs a
    block of that shape: memory already touched, where a fresh block page-faults every few
    kilobytes on its first write (each new request's first rows, on both hosts; the allocator
    reuses freed memory too, but not always touched memory). A block is handed out again
    only when nothing else holds it (a snapshot's chunks, a view handed out); the newest
    blocks given, up to `max_bytes`, are kept, older ones left to the allocator."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.kept = max_bytes, 0
        self._free: list[np.ndarray] = []  # newest last: the one most likely still cached
        self._lock = threading.Lock()  # the engine's and the service's histories share it

    def __deepcopy__(self, memo) -> BlockPool:
        return self  # a deep copy of a history still draws on its process's pool

    def give(self, block: np.ndarray) -> None:
        """Keep `block` for a later take; the oldest kept go when they exceed `max_bytes`."""
        with self._lock:
            # a block of a sixteenth of the pool or more (a client's, before it learns the
            # worker's window) would crowd out the window-sized ones the pool is for
            if 16 * block.nbytes > self.max_bytes or any(b is block for b in self._free):
                return
            self._free.append(block)
            self.kept += block.nbytes
            while self.kept > self.max_bytes:
                self.kept -= self._free.pop(0).nbytes

    def take(self, rows: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """A block of `rows` rows of `shape` and `dtype`: a free one kept, else a new one."""
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                block = self._free[i]
                # held by the list and `block` alone: no history's chunks, no view
                if block.shape == (rows, *shape) and block.dtype == dtype \
                        and sys.getrefcount(block) <= HELD_ONCE + 1:
                    del self._free[i]
                    self.kept -= block.nbytes
                    return block
                del block
        return np.empty((rows, *shape), dtype)


POOL = BlockPool(256 << 20)  # the process's: a few dozen Flash-wide window blocks


class Chunks:
    """The newest `keep` rows of an append-only sequence, each row copied once: rows are
    written into blocks of `keep` rows past the newest row, and nothing held is ever moved
    (a row is large; a buffer that slides would copy each row a second time). The rows held
    are views of at most two or three blocks (`chunks`, oldest first): the newest few rows
    are a view of the newest, all of them a join. As with Tail, a block is written only past
    the end of every copy sharing it (`written`), so a shallow copy is a snapshot. Blocks come
    from `pool`, and go back to it when their rows all fall out of those kept (`release`:
    all of them)."""

    def __init__(self, keep: int, shape: tuple, dtype: np.dtype, pool: BlockPool = POOL):
        self.keep, self.pool = keep, pool
        self.empty = np.empty((0, *shape), dtype)
        self.empty.flags.writeable = False
        self.chunks: list[np.ndarray] = []
        self.block, self.at, self.written = None, 0, [0]  # the newest block, our end in it
        self.readable = None  # a read-only view of the newest block: chunks are sliced from it
        self.count = 0  # rows the chunks hold: the oldest may reach back past those kept
        self.kept = 0   # the newest rows kept: at most `keep` as of the last append

    def __copy__(self) -> Chunks:
        shared = object.__new__(Chunks)
        shared.__dict__ = self.__dict__.copy()
        shared.chunks = self.chunks.copy()
        return shared

    def __deepcopy__(self, memo) -> Chunks:
        own = object.__new__(Chunks)  # its read-only view remade over its own newest block
        own.__dict__ = copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "readable"}, memo)
        own.readable = None if own.block is None else _read_only_view(own.block)
        for chunk in own.chunks:
            chunk.flags.writeable = False  # arrays of their own: read-only too
        return own

    def __len__(self) -> int:
        return self.kept

    def append(self, items: np.ndarray) -> None:
        items = items[max(len(items) - self.keep, 0):]
        k, block, at = len(items), self.block, self.at
        if not k:
            return
        if block is not None and self.written[0] == at and at + k <= len(block):  # past every copy's end
            start = at - len(self.chunks[-1])
            self.chunks.pop()
        else:
            block = self.block = self.pool.take(max(self.keep, k), self.empty.shape[1:], self.empty.dtype)
            self.readable = _read_only_view(block)
            start = at = 0
            self.written = [0]
        block[at:at + k] = items
        self.at = self.written[0] = at + k
        # its base is the block: a block owns its memory (np.empty, or a deep copy's), and numpy
        # gives a view of a view the owner as its base
        self.chunks.append(self.readable[start:at + k])
        self.count += k
        self.kept = min(self.kept + k, self.keep)
        while self.count - len(self.chunks[0]) >= self.kept:  # a chunk wholly before those kept
            dropped = self.chunks.pop(0)
            self.count -= len(dropped)
            if dropped.base is not None and dropped.base is not block:  # (a deep copy's are not views)
                self.pool.give(dropped.base)

    def release(self) -> None:
        """Hand the blocks written through to the pool and hold none: this object is done
        with. The newest block, written only up to its end, is left to the allocator: a
        block that faults past where it was written is what the pool exists to avoid."""
        full = {id(c.base): c.base for c in self.chunks if c.base is not None and c.base is not self.block}
        if self.block is not None and self.at == len(self.block):
            full[id(self.block)] = self.block
        self.chunks, self.block, self.readable, self.count, self.kept = [], None, None, 0, 0
        for block in full.values():
            self.pool.give(block)

    def newest(self, k: int) -> np.ndarray:
        """The newest k rows: a view when they lie in one block, else a join of just them."""
        k = min(k, len(self))
        last = self.chunks[-1] if self.chunks else self.empty
        if k <= len(last):
            return last[len(last) - k:]
        parts, need = [], k
        for chunk in reversed(self.chunks):
            parts.append(chunk[max(len(chunk) - need, 0):])
            need -= len(parts[-1])
            if not need:
                break
        joined = np.concatenate(parts[::-1])
        joined.flags.writeable = False
        return joined

    def view(self) -> np.ndarray:
        return self.newest(self.kept)


class Lineage:
    """One sequence of rows: histories sharing it (a history and its shallow copies) hold
    prefixes of the same rows. `count` is how many rows the furthest of them added; a
    history behind it that appends diverges and takes a new lineage."""

    def __init__(self) -> None:
        self.count = 0


class History:
    """dtype: what the rows are kept as (one of rows.DTYPES; rows of another type are cast
    on append)."""

    def __init__(self, max_tokens: int, window: int, feature: int, dtype: np.dtype = np.float32):
        self.feature, self.dtype = feature, np.dtype(dtype)
        self._tokens = Tail(max_tokens, (), np.dtype(np.int32))
        self._window = window
        self.length = 0  # committed tokens ever (positions), not just those kept
        self.rows = None

    def __copy__(self) -> History:
        """A snapshot: its own ends over the same buffers (neither side's appends change
        what the other reads)."""
        snapshot = object.__new__(History)
        snapshot.__dict__ = self.__dict__.copy()
        snapshot._tokens, snapshot._rows = self._tokens.__copy__(), self._rows.__copy__()
        return snapshot

    @property
    def max_tokens(self) -> int:
        return self._tokens.keep

    @max_tokens.setter
    def max_tokens(self, n: int) -> None:
        self._tokens.keep = n

    @property
    def window(self) -> int:
        return self._window

    @window.setter
    def window(self, n: int) -> None:
        """Kept rows beyond a smaller window go at the next append (or assign the rows)."""
        self._window = self._rows.keep = n

    @property
    def tokens(self) -> np.ndarray:
        """The last <= max_tokens committed tokens (int32, read-only)."""
        return self._tokens.view()

    @property
    def rows(self) -> np.ndarray | None:
        """The last <= window hidden rows ([n, feature], self.dtype); None for a token-only
        drafter. Read-only: assign to replace them (that starts a new lineage)."""
        return self._rows.view() if self.feature else None

    @rows.setter
    def rows(self, rows: np.ndarray | None) -> None:
        self.lineage, self.rows_added = Lineage(), 0  # rows_added: on this lineage, by this history
        if "_rows" in self.__dict__:
            self._rows.release()
        self._rows = Chunks(self._window, (self.feature,), self.dtype)
        if self.feature and rows is not None and len(rows):
            self._append(rows)

    def release(self) -> None:
        """Its rows' blocks to the pool, for the next request's (this one is done)."""
        self.rows = None

    @property
    def row_count(self) -> int:
        """How many hidden rows are kept (len(rows), without joining them)."""
        return len(self._rows) if self.feature else 0

    def newest_rows(self, k: int) -> np.ndarray:
        """The newest k kept rows (a view: no copy while they came in one append)."""
        return self._rows.newest(k)

    @property
    def nbytes_max(self) -> int:
        return 4 * self.max_tokens + (2 * self.dtype.itemsize * self.window * self.feature if self.feature else 0)

    def check(self, tokens: np.ndarray, rows: np.ndarray | None, opening: bool,
              finite: bool = False) -> str | None:
        """Why (tokens, rows) cannot extend this history, or None. `finite`: the caller
        found the rows finite already (a round's rows are checked in one pass)."""
        if len(tokens) == 0:
            return "no tokens"
        if not self.feature:
            return "this drafter takes no hidden rows" if rows is not None else None
        have = 0 if rows is None else len(rows)
        if rows is not None and rows.shape[1] != self.feature:
            return f"hidden rows of width {rows.shape[1]}, the drafter takes {self.feature}"
        if opening:
            if have > len(tokens) - 1:
                return f"open with {len(tokens)} tokens carries {have} hidden rows (at most one per token but the newest)"
            if have < min(len(tokens) - 1, self.window):
                return f"open carries {have} hidden rows, needs the last {min(len(tokens) - 1, self.window)}"
        elif have != len(tokens):
            return f"{len(tokens)} new tokens need {len(tokens)} hidden rows, got {have}"
        if rows is not None and not finite and not all_finite(rows):
            return "hidden rows hold NaN or infinity"
        return None

    def reset(self, tokens: np.ndarray, rows: np.ndarray | None, length: int | None = None) -> None:
        self._tokens = Tail(self.max_tokens, (), np.dtype(np.int32))
        self.length = 0
        self.rows = None
        self.extend(tokens, rows)
        if length is not None:
            self.length = length

    def extend(self, tokens: np.ndarray, rows: np.ndarray | None) -> None:
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        self._tokens.append(tokens)
        if self.feature and rows is not None and len(rows):
            self._append(rows)
        self.length += len(tokens)

    def _append(self, rows: np.ndarray) -> None:
        if self.rows_added != self.lineage.count:  # a copy went further: our rows differ from here
            self.lineage = Lineage()
        self._rows.append(cast(np.asarray(rows), self.dtype))
        self.rows_added += len(rows)
        self.lineage.count = self.rows_added

    def open_payload(self) -> tuple[np.ndarray, np.ndarray | None, int]:
        """(tokens, rows, length) that recreate this history on the other side."""
        return self.tokens, self.rows, self.length
