"""`python -m remote_engram.bench [--json] [--out F]`: Engram fetches, local vs remote, in one
run, interleaved, as ratios; and the server-side gather rate.

* Shapes: decode batches of 1, 4 and 16 tokens and a 32,768-token prefill; each call fetches
  tokens x 24 rows x 2 layers (hashed from random token ids, deduplicated as the client
  does). Paths: the local shard (page cache hot), remote over tcp, remote over shm, each
  through EngramClient. `remote_over_local` = local seconds per call / remote seconds.
* `server_gather_rows_per_s_per_core`: one thread gathering batches of 4,096 tokens x 24
  rows from a >= 4 GiB table in RAM (what the tcp server does per READ; on verbs the NIC
  does it instead).
Tables are synthetic, one shard per layer (rank 0 of 1 owns all 24 columns).
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from ofl.cli import emit_result
from ofl.gather import gather_into

from . import __version__
from .client import EngramClient
from .geometry import ROW_BYTES, EngramGeometry
from .hashing import row_ids
from .synth import write_shards

SHAPES = {"decode-1": 1, "decode-4": 4, "decode-16": 16, "prefill-32k": 32_768}
BYTES_PER_TOKEN_LAYER = 24 * ROW_BYTES  # 6,336


def start_server(shard_dir: str, backend: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "remote_engram.cli", "serve", "--shards",
                             shard_dir, "--backend", backend, "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "remote-engram serve:" not in line:
        proc.kill()
        raise RuntimeError(f"{backend} server did not start: {line!r}")
    return proc, line.rsplit(" on ", 1)[1].strip()


def time_calls(client: EngramClient, batches: list[dict]) -> list[float]:
    times = []
    for ids in batches:
        t = time.perf_counter()
        for layer, layer_ids in ids.items():
            client.fetch(layer, layer_ids)
        times.append(time.perf_counter() - t)
    return times


def summary(times: list[float], rows: int) -> dict:
    us = np.asarray(times) * 1e6
    return {"calls": len(times), "rows_per_call": rows,
            "rows_per_s": rows / float(np.median(times)),
            "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


def bench_paths(geo: EngramGeometry, shard_dir: str, calls: int) -> dict:
    rng = np.random.default_rng(0)
    token_map = rng.integers(0, geo.vocab, 50_000)
    servers = {b: start_server(shard_dir, b) for b in ("tcp", "shm")}
    clients = {"local": EngramClient(geometry=geo, rank=0, nranks=1, shard_dir=shard_dir)}
    for b, (_, address) in servers.items():
        clients[b] = EngramClient(geometry=geo, rank=0, nranks=1, shard_dir=shard_dir,
                                  remote=address, backend=b, deadline_s=30)
    out = {}
    try:
        for shape, tokens in SHAPES.items():
            n = max(3, calls // (1 + tokens // 1024))
            batches = [{layer: row_ids(geo, layer, rng.integers(0, 50_000, (1, tokens)),
                                       token_map) for layer in geo.layers} for _ in range(n)]
            for c in clients.values():  # warm: page cache, connections, scratch buffers
                time_calls(c, batches[:2])
            times = {name: [] for name in clients}
            for k, batch in enumerate(batches):  # interleaved, rotating who goes first
                order = list(clients)[k % 3:] + list(clients)[:k % 3]
                for name in order:
                    times[name] += time_calls(clients[name], [batch])
            rows = tokens * geo.columns * len(geo.layers)
            res = {name: summary(t, rows) for name, t in times.items()}
            for b in servers:
                res[f"{b}_remote_over_local"] = res[b]["rows_per_s"] / res["local"]["rows_per_s"]
            out[shape] = res
        for b in servers:
            if clients[b].stats["fallbacks"]:
                raise RuntimeError(f"{b}: {clients[b].stats['fallbacks']} fallbacks during the bench")
    finally:
        for c in clients.values():
            c.close()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=10)
    return out


def bench_server_gather(table_bytes: int, seconds: float) -> dict:
    """One thread, batches of 4,096 tokens x 24 rows, random rows of a RAM table."""
    mm = mmap.mmap(-1, table_bytes)
    table = np.frombuffer(mm, np.uint8)
    table[:] = 0x5A  # touch every page: the table is resident, as on the server
    rows = table_bytes // ROW_BYTES
    batch = 4096 * 24
    dest = np.empty(batch * ROW_BYTES, np.uint8)
    rng = np.random.default_rng(1)
    times = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop or len(times) < 5:
        offsets = rng.integers(0, rows, batch).astype(np.uint64) * ROW_BYTES
        t = time.perf_counter()
        gather_into(table, offsets, ROW_BYTES, dest)
        times.append(time.perf_counter() - t)
    del table
    mm.close()
    return {"table_bytes": table_bytes, "batch_rows": batch, "batches": len(times),
            "server_gather_rows_per_s_per_core": batch / float(np.median(times))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote_engram.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--prime-start", type=int, default=160_000,
                   help="table size: 24 primes above this per layer (160,000: ~1 GB per layer)")
    p.add_argument("--calls", type=int, default=200, help="calls per decode shape (200)")
    p.add_argument("--gather-gib", type=float, default=4.0, help="server-gather table (4 GiB)")
    p.add_argument("--gather-seconds", type=float, default=5.0)
    p.add_argument("--workdir", help="where to write the synthetic shards (a temp folder)")
    args = p.parse_args(argv)
    geo = EngramGeometry(layers=(1, 14), vocab=99_092, prime_start=args.prime_start)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        t = time.perf_counter()
        write_shards(tmp, geo, nranks=1)
        print(f"synthetic shards: {sum(geo.rows(x) for x in geo.layers) * ROW_BYTES / 2**30:.2f} "
              f"GiB in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        paths = bench_paths(geo, tmp, args.calls)
    gather = bench_server_gather(int(args.gather_gib * 2**30), args.gather_seconds)
    result = {
        "version": __version__, "host": platform.node(), "cpus": os.cpu_count(),
        "table_rows_per_layer": {str(x): geo.rows(x) for x in geo.layers},
        "shapes": paths, "server_gather": gather,
        "server_gather_rows_per_s_per_core": gather["server_gather_rows_per_s_per_core"],
        "goals": {"server_gather_rows_per_s_per_core": 10e6},
        "budget": {"bytes_per_token_per_layer": BYTES_PER_TOKEN_LAYER,
                   "bytes_per_token_per_layer_per_rank": BYTES_PER_TOKEN_LAYER // 2,
                   "tokens_per_s_per_40gbit_link_both_layers":
                       40e9 / 8 / (BYTES_PER_TOKEN_LAYER // 2 * 2)},
    }
    emit_result(result, args.out, args.json, print_table)
    return 0


def print_table(r: dict) -> None:
    print(f"{'shape':12} {'path':6} {'rows/call':>10} {'rows/s':>12} {'p50 us':>10} "
          f"{'p99 us':>10} {'remote/local':>12}")
    for shape, res in r["shapes"].items():
        for path in ("local", "tcp", "shm"):
            s = res[path]
            ratio = "" if path == "local" else f"{res[f'{path}_remote_over_local']:.3f}"
            print(f"{shape:12} {path:6} {s['rows_per_call']:>10,} {s['rows_per_s']:>12,.0f} "
                  f"{s['p50_us']:>10.1f} {s['p99_us']:>10.1f} {ratio:>12}")
    g = r["server_gather"]
    print(f"\nserver gather, one core, {g['table_bytes'] / 2**30:.0f} GiB table, batches of "
          f"{g['batch_rows']:,} rows: {g['server_gather_rows_per_s_per_core'] / 1e6:.2f} M rows/s "
          "(goal >= 10 M)")
    b = r["budget"]
    print(f"budget: {b['bytes_per_token_per_layer']:,} B/token/layer "
          f"({b['bytes_per_token_per_layer_per_rank']:,} per rank); one 40 Gb/s link carries "
          f"{b['tokens_per_s_per_40gbit_link_both_layers']:,.0f} tokens/s for both layers")


if __name__ == "__main__":
    sys.exit(main())
