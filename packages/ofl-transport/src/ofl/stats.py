"""Thread-safe counters with Prometheus text exposition (no global registry, so many
servers and connections can live in one process)."""

from __future__ import annotations

import threading
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
