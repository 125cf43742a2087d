"""Thread-safe counters with Prometheus text exposition (no global registry, so many
servers and connections can live in one process), and the rate-limited log of peers a
server drops."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter


class Stats:
    def __init__(self, prefix: str, labels: dict[str, str] | None = None):
        self.prefix = prefix
        self.labels = labels or {}
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._counts[name] += value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def prometheus(self) -> str:
        label = ",".join(f'{k}="{v}"' for k, v in sorted(self.labels.items()))
        label = "{" + label + "}" if label else ""
        lines = []
        for name, value in sorted(self.snapshot().items()):
            metric = f"{self.prefix}_{name}_total"
            lines += [f"# TYPE {metric} counter", f"{metric}{label} {value}"]
        return "\n".join(lines) + "\n"


class PeerLog:
    """Bad input from a peer is counted and logged as one line - the peer, the reason and
    the counter's total, no traceback - at most `burst` lines per `window_s`, so a hostile
    peer cannot flood the log; lines held back are counted (`log_lines_suppressed`) and
    the next line says how many."""

    def __init__(self, logger: logging.Logger, stats: Stats, where: str, burst: int = 10,
                 window_s: float = 10.0):
        self.logger, self.stats, self.where = logger, stats, where
        self.burst, self.window_s = burst, window_s
        self._lock = threading.Lock()
        self._window_start = -window_s
        self._lines = 0
        self._held = 0

    def drop(self, peer: str, counter: str, reason: str) -> None:
        self.stats.add(counter)
        with self._lock:
            now = time.monotonic()
            if now - self._window_start >= self.window_s:
                self._window_start, self._lines = now, 0
            if self._lines >= self.burst:
                self._held += 1
                self.stats.add("log_lines_suppressed")
                return
            self._lines += 1
            held, self._held = self._held, 0
        more = f"; {held} similar lines held back" if held else ""
        self.logger.warning("%s: %s: %s (%s: %d%s)", self.where, peer, reason, counter,
                            self.stats[counter], more)
