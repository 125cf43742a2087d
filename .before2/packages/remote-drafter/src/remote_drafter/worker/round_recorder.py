"""Gate rounds recorded from the requests a worker serves (`worker --record-gate-rounds
FILE`): the rounds file the EXL3 fidelity gate measures a pack on (models.fidelity_gate)."""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from remote_drafter.engine.sampling import is_greedy
from remote_drafter.models.fidelity_gate import MIN_ROUNDS, Round, write_rounds

log = logging.getLogger(__name__)


class RoundRecorder:
    """Gate rounds from the requests a worker serves (`worker --record-gate-rounds FILE`).
    At T = 0 speculative decoding commits exactly the target's greedy tokens, and the rows
    the engine sends are the target's taps: a request's history is a recording of the target.
    A round starts at a commit (its anchor: the newest token, at position t; the window's rows
    before it), at most one per request at a time and `spacing` positions apart; it completes
    once `depth` more tokens are committed (its continuation). With `count` rounds in, the
    file is written (beside the serving, in a thread) and recording stops; `close()` writes
    what there is. Requests at other temperatures are not recorded."""

    def __init__(self, path: str, count: int, depth: int, target_digest: str | None,
                 spacing: int = 256, hidden_layers=()):
        why = recording_refusal(path, count)
        if why:
            raise ValueError(why)
        self.path, self.count, self.depth, self.spacing = path, count, depth, spacing
        self.target_digest, self.hidden_layers = target_digest, list(hidden_layers)
        self.done: list[Round] = []
        self.pending: dict = {}   # request key -> (t, taps, prefix)
        self.last_start: dict = {}  # request key -> the anchor of its last round
        self.writer = None
        self.written = 0          # rounds in the file, once written
        self.error: str | None = None  # why writing it failed

    @property
    def full(self) -> bool:
        return len(self.done) >= self.count

    def seen(self, key, history, temperature: float) -> None:
        """After a request's open or commit (its history as it now stands)."""
        if self.full or not is_greedy(temperature):
            return
        kept = history.length - len(history.tokens)  # positions before the kept tokens
        if key in self.pending:
            t, taps, prefix = self.pending[key]
            if history.length < t + 1 + self.depth:
                return
            del self.pending[key]
            start = t + 1 - kept
            if start >= 0:  # else the continuation already left the kept tokens
                self.done.append(Round(taps, prefix, history.tokens[start:start + self.depth].astype(np.int64)))
                if self.full:
                    self._write()
            return
        t = history.length - 1
        if t - self.last_start.get(key, -self.spacing) < self.spacing or t < 1:
            return
        rows = history.rows
        if rows is not None and len(rows) < min(t, history.window):
            return  # opened with fewer rows than its window reads: the gate could not use it
        self.last_start[key] = t
        taps = None if rows is None else np.array(rows, np.float16)
        # tokens before the kept ones are zeros: the gated drafters read the anchor, the
        # length and the window's rows, not earlier tokens
        prefix = np.concatenate([np.zeros(kept, np.int64), history.tokens.astype(np.int64)])
        self.pending[key] = (t, taps, prefix)

    def forget(self, key) -> None:
        self.pending.pop(key, None)
        self.last_start.pop(key, None)

    def close(self) -> None:
        if self.writer is None and self.done:
            self._write()
        if self.writer is not None:
            self.writer.join()

    def _write(self) -> None:
        rounds = list(self.done)
        self.writer = threading.Thread(target=self._save, args=(rounds,), name="gate-rounds",
                                       daemon=False)
        self.writer.start()

    def _save(self, rounds: list[Round]) -> None:
        try:
            write_rounds(self.path, rounds, self.target_digest, hidden_layers=self.hidden_layers)
        except Exception as exc:  # noqa: BLE001 - the worker serves on; status says why
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("writing %d gate rounds to %s failed: %s", len(rounds), self.path, self.error)
            return
        self.written = len(rounds)
        log.info("wrote %d gate rounds to %s", len(rounds), self.path)


def recording_refusal(path: str, count: int) -> str | None:
    """Why rounds cannot be recorded into `path` (checked at start-up, not after hours)."""
    if count < 1:
        return f"--gate-rounds {count}: record at least 1 (the gate needs {MIN_ROUNDS})"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"--record-gate-rounds {path}: {folder} is not a folder this process can write"
    return None
