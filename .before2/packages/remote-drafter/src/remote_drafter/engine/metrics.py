"""Counters and latency histograms in Prometheus text (worker and clients), declared up
front so a dashboard sees every failure kind at zero before it first happens.

A round counts per entry, so counting must cost next to nothing: values are plain numbers
under one lock, and prometheus-client's collector reads them only when scraped (its own
Counter and Histogram objects take a lock and validate on every call)."""

from __future__ import annotations

import bisect
import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
MAX_SAMPLES = 100_000  # per histogram, for its percentiles; beyond it the newest half is kept


class Metrics:
    def __init__(self, prefix: str, counters: dict[str, str], histograms: dict[str, str]):
        self.prefix, self._docs, self._histogram_docs = prefix, counters, histograms
        self._lock = threading.Lock()
        self._values = dict.fromkeys(counters, 0.0)
        # per histogram: observations per bucket (the last: above every bound), their sum
        self._buckets = {name: [0] * (len(LATENCY_BUCKETS) + 1) for name in histograms}
        self._sums = dict.fromkeys(histograms, 0.0)
        self._samples: dict[str, list[float]] = {name: [] for name in histograms}
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def inc(self, name: str, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counter {name} decreased by {amount}")
        with self._lock:
            self._values[name] += amount

    def add(self, counts: dict[str, float]) -> None:
        """Several counters at once, under one lock (a round's per-entry counts)."""
        if any(amount < 0 for amount in counts.values()):
            raise ValueError(f"a counter decreased: {counts}")
        with self._lock:
            for name, amount in counts.items():
                self._values[name] += amount

    def observe(self, name: str, seconds: float) -> None:
        self.observe_all(name, [seconds])

    def observe_all(self, name: str, seconds: list[float]) -> None:
        """Several observations of one histogram, under one lock."""
        with self._lock:
            buckets, samples = self._buckets[name], self._samples[name]
            for value in seconds:
                buckets[bisect.bisect_left(LATENCY_BUCKETS, value)] += 1
            self._sums[name] += sum(seconds)
            samples.extend(seconds)
            if len(samples) > MAX_SAMPLES:
                del samples[: len(samples) // 2]

    def value(self, name: str) -> float:
        return self._values[name]

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self._values)
            taken = {name: sorted(samples) for name, samples in self._samples.items() if samples}
        for name, s in taken.items():
            out[f"{name}_p50_ms"] = 1e3 * s[len(s) // 2]
            out[f"{name}_p99_ms"] = 1e3 * s[min(len(s) - 1, int(len(s) * 0.99))]
            out[f"{name}_max_ms"] = 1e3 * s[-1]
            out[f"{name}_count"] = len(s)
        return out

    def collect(self):
        """prometheus-client's collector interface: the values as of this scrape."""
        with self._lock:
            values, buckets, sums = dict(self._values), {k: list(v) for k, v in self._buckets.items()}, dict(self._sums)
        for name, doc in self._docs.items():
            yield CounterMetricFamily(f"{self.prefix}_{name}", doc, value=values[name])
        for name, doc in self._histogram_docs.items():
            cumulative, total = [], 0
            for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], buckets[name]):
                total += count
                cumulative.append((bound, total))
            yield HistogramMetricFamily(f"{self.prefix}_{name}_seconds", doc, buckets=cumulative,
                                        sum_value=sums[name])

    def prometheus(self) -> str:
        return generate_latest(self.registry).decode()
