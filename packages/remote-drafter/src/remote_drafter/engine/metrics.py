"""Counters and latency histograms in Prometheus text (worker and clients), declared up
front so a dashboard sees every failure kind at zero before it first happens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class Metrics:
    def __init__(self, prefix: str, counters: dict[str, str], histograms: dict[str, str]):
        self.registry = CollectorRegistry()
        self.prefix = prefix
        self.counters = {name: Counter(f"{prefix}_{name}", doc, registry=self.registry)
                         for name, doc in counters.items()}
        self.histograms = {name: Histogram(f"{prefix}_{name}_seconds", doc, registry=self.registry,
                                           buckets=LATENCY_BUCKETS)
                           for name, doc in histograms.items()}
        self._samples: dict[str, list[float]] = {name: [] for name in histograms}

    def inc(self, name: str, amount: float = 1) -> None:
        self.counters[name].inc(amount)

    def observe(self, name: str, seconds: float) -> None:
        self.histograms[name].observe(seconds)
        samples = self._samples[name]
        samples.append(seconds)
        if len(samples) > 100_000:  # bounded: keep the newest half
            del samples[: len(samples) // 2]

    def value(self, name: str) -> float:
        return self.counters[name]._value.get()

    def snapshot(self) -> dict:
        out = {name: self.value(name) for name in self.counters}
        for name, samples in self._samples.items():
            if samples:
                s = sorted(samples)
                out[f"{name}_p50_ms"] = 1e3 * s[len(s) // 2]
                out[f"{name}_p99_ms"] = 1e3 * s[min(len(s) - 1, int(len(s) * 0.99))]
                out[f"{name}_max_ms"] = 1e3 * s[-1]
                out[f"{name}_count"] = len(s)
        return out

    def prometheus(self) -> str:
        return generate_latest(self.registry).decode()
