"""`python -m ofl.bench [--json]`: ofl against the plain baselines it must keep up with,
measured in one run, interleaved (A, B, A, B, ...), reported as ratios.

* tcp_over_raw_socket: 64 MiB reads over ofl tcp vs a plain zero-copy Python socket doing
  the same transfer (server `sendall` from the buffer, client `recv_into` a preallocated one,
  with the same socket options ofl sets: TCP_NODELAY, 8 MiB buffers).
* shm_over_memcpy: 64 MiB reads over ofl shm vs a numpy copy between two shared buffers.
* messages_over_raw_socket: message round trips (a request of 16 KiB to 4 MiB sent from
  its parts, a 1 KiB reply) over ofl tcp vs a plain Python socket doing the same (the
  request's parts in one `sendmsg`, received into a buffer kept from the last one): the time
  ofl adds to a message, as remote-drafter's rounds send them. `raw_message_round_trip` is the
  same baseline for another benchmark's own payloads (the time its payload takes on this link).
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


MESSAGE_SIZES = [16 << 10, 256 << 10, 1 << 20, 4 << 20]
MESSAGE_SIZE = struct.Struct("<QQ")  # a baseline message's header: request and reply bytes


def raw_message_server() -> None:
    """Baseline message server: a plain socket, each request received whole into a buffer kept
    from the last one, answered with the reply size its header asks for."""
    lsock = socket.create_server(("127.0.0.1", 0))
    print(f"raw on {lsock.getsockname()[1]}", flush=True)
    conn, _ = lsock.accept()
    set_socket_options(conn)
    buf = memoryview(bytearray(1 << 20))
    replies: dict[int, bytes] = {}
    while True:
        if conn.recv_into(buf[:MESSAGE_SIZE.size], MESSAGE_SIZE.size, socket.MSG_WAITALL) < MESSAGE_SIZE.size:
            return
        size, reply = MESSAGE_SIZE.unpack(buf[:MESSAGE_SIZE.size])
        if size > len(buf):
            buf = memoryview(bytearray(size))
        got = 0
        while got < size:
            got += conn.recv_into(buf[got:size], size - got)
        conn.sendall(replies.setdefault(reply, bytes(reply)))


def message_server() -> None:
    """ofl's message server answering each message with the reply size its first 8 bytes ask for."""
    from .server import Server
    srv = Server("tcp", "127.0.0.1", 0, identity="ofl-bench",
                 handler=lambda payload, peer: bytes(int.from_bytes(payload[:8], "little"))).start()
    print(f"ofl on {srv.address[1]}", flush=True)
    sys.stdin.read()
    srv.stop()


def _bench_server(flag: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "ofl.bench", flag], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline().split()[-1])


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.terminate()
    proc.wait(timeout=10)


def send_parts(sock: socket.socket, parts: list) -> None:
    """sendmsg until every part is sent (a large message may go in several calls)."""
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    while pending:
        sent = sock.sendmsg(pending[:64])
        while sent:
            if sent >= len(pending[0]):
                sent -= len(pending.pop(0))
            else:
                pending[0], sent = pending[0][sent:], 0


class RawMessages:
    """A plain-socket client of raw_message_server, in a process of its own."""

    def __init__(self):
        self.proc, port = _bench_server("--raw-message-server")
        self.sock = socket.create_connection(("127.0.0.1", port))
        set_socket_options(self.sock)
        self.reply = bytearray(1 << 20)

    def request(self, parts: list, reply_bytes: int) -> None:
        size = sum(len(memoryview(p).cast("B")) for p in parts)
        send_parts(self.sock, [MESSAGE_SIZE.pack(size, reply_bytes), *parts])
        if reply_bytes > len(self.reply):
            self.reply = bytearray(reply_bytes)
        view, got = memoryview(self.reply), 0
        while got < reply_bytes:
            got += self.sock.recv_into(view[got:reply_bytes], reply_bytes - got)

    def close(self) -> None:
        self.sock.close()
        _stop(self.proc)


def raw_message_round_trip(request_bytes: float, reply_bytes: float, rounds: int = 200) -> dict:
    """p50/p99 of a message round trip over a plain socket to a process on this machine: a
    request of `request_bytes` and a reply of `reply_bytes` (the time such a payload takes on
    this link, with no protocol around it)."""
    raw = RawMessages()
    try:
        parts, times = [np.zeros(int(request_bytes), np.uint8)], []
        for i in range(rounds + 10):  # the first ten warm the path up
            t = time.perf_counter()
            raw.request(parts, int(reply_bytes))
            if i >= 10:
                times.append(time.perf_counter() - t)
    finally:
        raw.close()
    ms = np.asarray(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "request_bytes": int(request_bytes), "reply_bytes": int(reply_bytes), "rounds": rounds}


def bench_messages(sizes: list[int], repeats: int, reply_bytes: int = 1024) -> dict:
    """ofl's message round trip against the plain socket's, per request size, interleaved."""
    ofl_proc, port = _bench_server("--message-server")
    raw = RawMessages()
    out = {}
    try:
        conn = Connection(f"127.0.0.1:{port}", backend="tcp")
        for size in sizes:
            parts = [reply_bytes.to_bytes(8, "little"), *np.array_split(np.zeros(size - 8, np.uint8), 16)]
            t_ofl, t_raw = interleaved(lambda _, p=parts: conn.request(p),
                                       lambda _, p=parts: raw.request(p, reply_bytes), list(range(repeats + 10)))
            p50_ofl, p50_raw = float(np.median(t_ofl[10:])) * 1e3, float(np.median(t_raw[10:])) * 1e3
            out[str(size)] = {"ofl_p50_ms": p50_ofl, "raw_socket_p50_ms": p50_raw,
                              "ratio": p50_ofl / p50_raw, "round_trips": repeats}
        conn.close()
    finally:
        raw.close()
        _stop(ofl_proc)
    return out


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
    p.add_argument("--message-repeats", type=int, default=200,
                   help="interleaved message round-trip pairs per size (200)")
    p.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--raw-message-server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--message-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.raw_server or args.raw_message_server or args.message_server:
        raw_server(args.region) if args.raw_server else \
            raw_message_server() if args.raw_message_server else message_server()
        return 0
    batches = [1, 64, 4096]
    result = {
        "ofl_version": __version__, "host": platform.node(), "python": platform.python_version(),
        "cpus": __import__("os").cpu_count(), "region_bytes": args.region,
        "tcp": bench_tcp_vs_raw(args.region, args.size, args.repeats),
        "shm": bench_shm_vs_memcpy(args.region, args.size, args.repeats),
        "messages": bench_messages(MESSAGE_SIZES, args.message_repeats),
        "gathers": {b: bench_gathers(b, args.region, batches, args.gather_seconds)
                    for b in ("tcp", "shm")},
    }
    result["tcp_over_raw_socket"] = result["tcp"]["ratio"]
    result["shm_over_memcpy"] = result["shm"]["ratio"]
    result["messages_over_raw_socket"] = {size: m["ratio"] for size, m in result["messages"].items()}
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
    print(f"{'messages (1 KiB replies)':24} {'ofl p50':>9} {'baseline':>9} {'ratio':>6}  (ms; ratio: ofl's time over the plain socket's)")
    for size, m in r["messages"].items():
        print(f"{int(size) // 1024:>20} KiB {m['ofl_p50_ms']:9.3f} {m['raw_socket_p50_ms']:9.3f} {m['ratio']:6.3f}")
    print()
    print(f"{'gathers (24 x 264 B/token)':28} {'tokens':>6} {'rows/s':>12} {'p50 us':>9} {'p99 us':>9}")
    for backend, per in r["gathers"].items():
        for tokens, g in per.items():
            print(f"{backend:28} {tokens:>6} {g['gather_rows_per_s']:12,.0f} "
                  f"{g['p50_us']:9.1f} {g['p99_us']:9.1f}")


if __name__ == "__main__":
    sys.exit(main())
