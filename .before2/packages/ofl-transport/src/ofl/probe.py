"""Link qualification: one-sided read bandwidth, small-read latency and message round trips,
per link and over all links at once. Every probe read is checked against the pattern the
server filled its region with, so a fast link that returns wrong bytes fails."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from .client import Connection
from .errors import OflError
from .region import Region

PROBE_REGION = "ofl-probe"
MiB = 1 << 20


def pattern(start: int, n: int) -> np.ndarray:
    """The bytes a probe region holds at [start, start + n): cheap, position-dependent."""
    i = np.arange(start, start + n, dtype=np.uint64)
    return ((i * np.uint64(2654435761)) >> np.uint64(11)).astype(np.uint8)


def fill(region: Region, chunk: int = 64 * MiB) -> None:
    for s in range(0, region.length, chunk):
        n = min(chunk, region.length - s)
        region.array[s:s + n] = pattern(s, n)


@dataclass
class LinkResult:
    link: str
    address: str
    backend: str
    bytes_per_read: int
    reads: int
    gbit_s: float
    gbit_s_min: float
    small_read_bytes: int
    small_p50_us: float
    small_p99_us: float
    message_p50_us: float
    message_p99_us: float


def _percentiles(samples_s: list[float]) -> tuple[float, float]:
    a = np.asarray(samples_s) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def bandwidth(conn: Connection, dest: Region, size: int, reads: int) -> list[float]:
    """Seconds per `size`-byte read, `reads` times, from rotating offsets."""
    region_len = conn.region(PROBE_REGION).length
    times = []
    for k in range(reads):
        offset = (k * size) % max(region_len - size + 1, 1)
        t = time.perf_counter()
        conn.read(PROBE_REGION, offset, size, dest)
        times.append(time.perf_counter() - t)
    return times


def verify(conn: Connection, dest: Region, size: int) -> None:
    conn.read(PROBE_REGION, 0, size, dest)
    if not np.array_equal(dest.array[:size], pattern(0, size)):
        raise OflError(f"{conn.where()}: probe read returned wrong bytes")


def probe_link(conn: Connection, *, size: int = 64 * MiB, reads: int = 8, small: int = 264,
               small_reads: int = 2000, messages: int = 2000) -> LinkResult:
    size = min(size, conn.region(PROBE_REGION).length)
    dest = Region.allocate("probe-dest", size)
    try:
        verify(conn, dest, size)
        bw = bandwidth(conn, dest, size, reads)
        rng = np.random.default_rng(0)
        limit = conn.region(PROBE_REGION).length - small
        lat = []
        for off in rng.integers(0, limit, small_reads).tolist():
            t = time.perf_counter()
            conn.read(PROBE_REGION, off, small, dest)
            lat.append(time.perf_counter() - t)
        # Small reads are verified too (last one; the others went to the same buffer).
        if not np.array_equal(dest.array[:small], pattern(off, small)):
            raise OflError(f"{conn.where()}: small read returned wrong bytes")
        msg, payload = [], b"x" * 64
        for _ in range(messages):
            t = time.perf_counter()
            if conn.request(payload) != payload:
                raise OflError(f"{conn.where()}: echo returned other bytes")
            msg.append(time.perf_counter() - t)
    finally:
        dest.close()
    gbit = [size * 8 / t / 1e9 for t in bw]
    s50, s99 = _percentiles(lat)
    m50, m99 = _percentiles(msg)
    return LinkResult(conn.link or "", "%s:%d" % conn.address, conn.backend_name, size, reads,
                      float(np.mean(gbit)), float(np.min(gbit)), small, s50, s99, m50, m99)


def probe_aggregate(conns: list[Connection], size: int = 64 * MiB, reads: int = 8) -> dict:
    """All links at once, one thread per link: total Gb/s over the wall time."""
    dests = [Region.allocate(f"agg-{i}", size) for i in range(len(conns))]
    errors: list[Exception] = []
    barrier = threading.Barrier(len(conns) + 1)

    def run(conn, dest):
        try:
            barrier.wait()
            bandwidth(conn, dest, size, reads)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c, d)) for c, d in zip(conns, dests, strict=True)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for d in dests:
        d.close()
    if errors:
        raise errors[0]
    total = size * reads * len(conns)
    return {"links": len(conns), "bytes": total, "seconds": wall, "gbit_s": total * 8 / wall / 1e9}


def as_dict(result: LinkResult) -> dict:
    return asdict(result)
