"""A request's bounded history: its newest committed tokens and the target's hidden rows
of all but the newest token (the lag of one: the newest token's row comes from the next
verification pass). Both sides keep one: the worker drafts from it, the client re-opens a
request from it after the worker lost state, so drafts after a re-open equal drafts
without one. Torch-free; not thread-safe (the service changes histories under its lock).

Rows are appended in amortised O(new rows): a buffer of up to 2 x window rows is written
past its newest row and moved to a fresh one only when full. Rows once handed out (`rows`,
read-only) are never rewritten, so a shallow copy is a snapshot (what the service drafts
from outside its lock). `lineage` and `rows_added` let a drafter keep its own copy of the
rows (on its device) and fetch only the rows added since it last looked."""

from __future__ import annotations

import numpy as np

from .rows import all_finite, cast


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
        self.max_tokens, self.window, self.feature = max_tokens, window, feature
        self.dtype = np.dtype(dtype)
        self.tokens = np.zeros(0, np.int32)
        self.length = 0  # committed tokens ever (positions), not just those kept
        self.rows = None

    @property
    def rows(self) -> np.ndarray | None:
        """The last <= window hidden rows ([n, feature], self.dtype); None for a token-only
        drafter. Read-only: assign to replace them (that starts a new lineage)."""
        if not self.feature:
            return None
        view = self._buf[self._start:self._end]
        view.flags.writeable = False
        return view

    @rows.setter
    def rows(self, rows: np.ndarray | None) -> None:
        self.lineage, self.rows_added = Lineage(), 0  # rows_added: on this lineage, by this history
        self._buf, self._start, self._end = np.zeros((0, self.feature), self.dtype), 0, 0
        if self.feature and rows is not None and len(rows):
            self._append(rows)

    @property
    def nbytes_max(self) -> int:
        return 4 * self.max_tokens + (2 * self.dtype.itemsize * self.window * self.feature if self.feature else 0)

    def check(self, tokens: np.ndarray, rows: np.ndarray | None, opening: bool) -> str | None:
        """Why (tokens, rows) cannot extend this history, or None."""
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
        if rows is not None and not all_finite(rows):
            return "hidden rows hold NaN or infinity"
        return None

    def reset(self, tokens: np.ndarray, rows: np.ndarray | None, length: int | None = None) -> None:
        self.tokens = np.zeros(0, np.int32)
        self.length = 0
        self.rows = None
        self.extend(tokens, rows)
        if length is not None:
            self.length = length

    def extend(self, tokens: np.ndarray, rows: np.ndarray | None) -> None:
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int32)])[-self.max_tokens:]
        if self.feature and rows is not None and len(rows):
            self._append(rows)
        self.length += len(tokens)

    def _append(self, rows: np.ndarray) -> None:
        rows = cast(np.asarray(rows), self.dtype)
        k, n = len(rows), self.window
        if self.rows_added != self.lineage.count:  # a copy went further: our rows differ from here
            self.lineage = Lineage()
            self.lineage.count = self.rows_added
        elif self._end + k <= len(self._buf):  # the buffer's tail is ours: write past what we handed out
            self._buf[self._end:self._end + k] = rows
            self._end += k
            self._start = max(self._start, self._end - n)
            self._added(k)
            return
        # A fresh buffer (never write where a copy may still read), twice what it keeps:
        # moving the kept rows costs at most one copy per row appended since the last move.
        kept = self._buf[max(self._start, self._end - max(n - k, 0)):self._end]
        rows = rows[max(len(rows) - n, 0):]
        buf = np.empty((min(2 * n, 2 * (len(kept) + len(rows))), self.feature), self.dtype)
        buf[:len(kept)] = kept
        buf[len(kept):len(kept) + len(rows)] = rows
        self._buf, self._start, self._end = buf, 0, len(kept) + len(rows)
        self._added(k)

    def _added(self, k: int) -> None:
        self.rows_added += k
        self.lineage.count = self.rows_added

    def open_payload(self) -> tuple[np.ndarray, np.ndarray | None, int]:
        """(tokens, rows, length) that recreate this history on the other side."""
        return self.tokens, self.rows, self.length
