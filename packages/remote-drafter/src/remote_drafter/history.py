"""A request's bounded history: its newest committed tokens and the target's hidden rows
of all but the newest token (the lag of one: the newest token's row comes from the next
verification pass). Both sides keep one: the worker drafts from it, the client re-opens a
request from it after the worker lost state, so drafts after a re-open equal drafts
without one. Torch-free."""

from __future__ import annotations

import numpy as np


class History:
    def __init__(self, max_tokens: int, window: int, feature: int):
        self.max_tokens, self.window, self.feature = max_tokens, window, feature
        self.tokens = np.zeros(0, np.int32)
        self.rows = np.zeros((0, feature), np.float32) if feature else None
        self.length = 0  # committed tokens ever (positions), not just those kept

    @property
    def nbytes_max(self) -> int:
        return 4 * self.max_tokens + (4 * self.window * self.feature if self.feature else 0)

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
        if rows is not None and not np.isfinite(rows).all():
            return "hidden rows hold NaN or infinity"
        return None

    def reset(self, tokens: np.ndarray, rows: np.ndarray | None, length: int | None = None) -> None:
        self.tokens = np.zeros(0, np.int32)
        self.rows = np.zeros((0, self.feature), np.float32) if self.feature else None
        self.length = 0
        self.extend(tokens, rows)
        if length is not None:
            self.length = length

    def extend(self, tokens: np.ndarray, rows: np.ndarray | None) -> None:
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int32)])[-self.max_tokens:]
        if self.feature and rows is not None and len(rows):
            self.rows = np.concatenate([self.rows, np.asarray(rows, np.float32)])[-self.window:]
        self.length += len(tokens)

    def open_payload(self) -> tuple[np.ndarray, np.ndarray | None, int]:
        """(tokens, rows, length) that recreate this history on the other side."""
        return self.tokens, self.rows, self.length
