"""`python -m ofl.bench [--json]`: ofl against the plain baselines it must keep up with,
measured in one run, interleaved (A, B, A, B, ...), reported as ratios.

* tcp_over_raw_socket: 64 MiB reads over ofl tcp vs a plain zero-copy Python socket doing
  the same transfer (server `sendall` from the buffer, client `recv_into` a preallocated one,
  with the same socket options ofl sets: TCP_NODELAY, 8 MiB buffers).
* shm_over_memcpy: 64 MiB reads over ofl shm vs a numpy copy between two shared buffers.
* Engram-shaped gathers (24 rows x 264 B per token at random offsets of a >= 1 GiB region)
  for batches of 1, 64 and 4,096 tokens: rows/s and per-call p50/p99, for tcp and shm.
Both servers run as separate processes, like the real offload host.
"""

from __future__ import annotations

import argparse
import platform
import socket
import struct
import subprocess
import sys
import time

import numpy as np

from . import __version__
from .channel import set_socket_options
from .cli import emit_result, parse_size, start_loopback_server
from .client import Connection
from .probe import PROBE_REGION, fill
from .region import Region

MiB = 1 << 20
ROW, ROWS_PER_TOKEN = 264, 24
REQ = struct.Struct("<QQ")


def raw_server(size: int) -> None:
    """Baseline server: answers (offset, length) with sendall from its buffer."""
    buf = Region.allocate("raw", size)
    fill(buf)
    lsock = socket.create_server(("127.0.0.1", 0))
    print(f"raw on {lsock.getsockname()[1]}", flush=True)
    conn, _ = lsock.accept()
    set_socket_options(conn)  # the same tuning ofl uses, so the ratio measures protocol cost
    head = bytearray(REQ.size)
    while True:
        view = memoryview(head)
        got = 0
        while got < REQ.size:
            k = conn.recv_into(view[got:])
            if not k:
                return
            got += k
        off, n = REQ.unpack(head)
        conn.sendall(buf.view[off:off + n])


def raw_read(sock: socket.socket, dest: memoryview, offset: int) -> None:
    sock.sendall(REQ.pack(offset, len(dest)))
    got = 0
    while got < len(dest):
        got += sock.recv_into(dest[got:])


def interleaved(a, b, offsets: list[int]) -> tuple[list[float], list[float]]:
    """Time a(off) and b(off) on the same offsets, alternating which goes first so neither
    always meets the other's warm caches."""
    ta, tb = [], []
    for k, off in enumerate(offsets):
        order = ((a, ta), (b, tb)) if k % 2 == 0 else ((b, tb), (a, ta))
        for fn, times in order:
            t = time.perf_counter()
            fn(off)
            times.append(time.perf_counter() - t)
    return ta, tb


def median_gbit(times: list[float], nbytes: int) -> float:
    return nbytes * 8 / float(np.median(times)) / 1e9


def bench_tcp_vs_raw(region_size: int, size: int, repeats: int) -> dict:
    proc, address = start_loopback_server("tcp", region_size)
    raw = subprocess.Popen([sys.executable, "-m", "ofl.bench", "--raw-server",
                            "--region", str(region_size)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(raw.stdout.readline().split()[-1])
        rsock = socket.create_connection(("127.0.0.1", port))
        set_socket_options(rsock)
        conn = Connection(address, backend="tcp")
        dest = Region.allocate("dest", size)
        offsets = [(k * size) % (region_size - size) for k in range(repeats)]
        interleaved(lambda off: conn.read(PROBE_REGION, off, size, dest),
                    lambda off: raw_read(rsock, dest.view, off), offsets[:2])  # warm-up
        t_ofl, t_raw = interleaved(lambda off: conn.read(PROBE_REGION, off, size, dest),
                                   lambda off: raw_read(rsock, dest.view, off), offsets)
        conn.close()
        rsock.close()
        dest.close()
    finally:
        for p in (proc, raw):
            p.terminate()
            p.wait(timeout=10)
    ofl_g, raw_g = median_gbit(t_ofl, size), median_gbit(t_raw, size)
    return {"ofl_gbit_s": ofl_g, "raw_socket_gbit_s": raw_g, "ratio": ofl_g / raw_g,
            "reads": repeats, "bytes": size}


def bench_shm_vs_memcpy(region_size: int, size: int, repeats: int) -> dict:
    proc, address = start_loopback_server("shm", region_size)
    try:
        conn = Connection(address, backend="shm")
        src = conn._backend.maps[conn.region(PROBE_REGION).index]  # the same mapping ofl reads
        dest = Region.allocate("dest", size)
        # Fault the whole mapping in first: the timed reads then compare copies, not page faults.
        for off in range(0, region_size - size + 1, size):
            conn.read(PROBE_REGION, off, size, dest)
        offsets = [(k * size) % (region_size - size) for k in range(repeats)]
        t_ofl, t_np = interleaved(lambda off: conn.read(PROBE_REGION, off, size, dest),
                                  lambda off: np.copyto(dest.array, src[off:off + size]), offsets)
        conn.close()
        dest.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    ofl_g, np_g = median_gbit(t_ofl, size), median_gbit(t_np, size)
    return {"ofl_gbit_s": ofl_g, "memcpy_gbit_s": np_g, "ratio": ofl_g / np_g, "reads": repeats,
            "bytes": size}


def bench_gathers(backend: str, region_size: int, batches: list[int], seconds: float) -> dict:
    proc, address = start_loopback_server(backend, region_size)
    out = {}
    try:
        conn = Connection(address, backend=backend)
        rng = np.random.default_rng(0)
        for tokens in batches:
            rows = tokens * ROWS_PER_TOKEN
            dest = Region.allocate("rows", rows * ROW)
            times = []
            stop = time.perf_counter() + seconds
            while time.perf_counter() < stop or len(times) < 5:
                offsets = rng.integers(0, region_size - ROW, rows, dtype=np.uint64)
                t = time.perf_counter()
                conn.gather(PROBE_REGION, offsets, ROW, into=dest)
                times.append(time.perf_counter() - t)
            dest.close()
            us = np.asarray(times) * 1e6
            out[str(tokens)] = {"rows": rows, "calls": len(times),
                                "gather_rows_per_s": rows / float(np.median(times)),
                                "p50_us": float(np.percentile(us, 50)),
                                "p99_us": float(np.percentile(us, 99))}
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ofl.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--region", type=parse_size, default=1 << 30, help="region size (1GiB)")
    p.add_argument("--size", type=parse_size, default=64 * MiB, help="bulk read size (64MiB)")
    p.add_argument("--repeats", type=int, default=20, help="interleaved bulk read pairs (20)")
    p.add_argument("--gather-seconds", type=float, default=3.0, help="time per gather batch (3)")
    p.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_server:
        raw_server(args.region)
        return 0
    batches = [1, 64, 4096]
    result = {
        "ofl_version": __version__, "host": platform.node(), "python": platform.python_version(),
        "cpus": __import__("os").cpu_count(), "region_bytes": args.region,
        "tcp": bench_tcp_vs_raw(args.region, args.size, args.repeats),
        "shm": bench_shm_vs_memcpy(args.region, args.size, args.repeats),
        "gathers": {b: bench_gathers(b, args.region, batches, args.gather_seconds)
                    for b in ("tcp", "shm")},
    }
    result["tcp_over_raw_socket"] = result["tcp"]["ratio"]
    result["shm_over_memcpy"] = result["shm"]["ratio"]
    result["goals"] = {"tcp_over_raw_socket": 0.9, "shm_over_memcpy": 0.9}
    emit_result(result, args.out, args.json, print_table)
    return 0


def print_table(r: dict) -> None:
    print(f"{'bulk 64 MiB reads':24} {'ofl Gb/s':>9} {'baseline':>9} {'ratio':>6}  goal")
    print(f"{'tcp vs raw socket':24} {r['tcp']['ofl_gbit_s']:9.2f} "
          f"{r['tcp']['raw_socket_gbit_s']:9.2f} {r['tcp_over_raw_socket']:6.3f}  >= 0.9")
    print(f"{'shm vs numpy memcpy':24} {r['shm']['ofl_gbit_s']:9.2f} "
          f"{r['shm']['memcpy_gbit_s']:9.2f} {r['shm_over_memcpy']:6.3f}  >= 0.9")
    print()
    print(f"{'gathers (24 x 264 B/token)':28} {'tokens':>6} {'rows/s':>12} {'p50 us':>9} {'p99 us':>9}")
    for backend, per in r["gathers"].items():
        for tokens, g in per.items():
            print(f"{backend:28} {tokens:>6} {g['gather_rows_per_s']:12,.0f} "
                  f"{g['p50_us']:9.1f} {g['p99_us']:9.1f}")


if __name__ == "__main__":
    sys.exit(main())
