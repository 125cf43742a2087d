"""`ofl`: serve a probe region, probe links, list environment variables.

  OFL_ALLOW=10.0.0.2 ofl serve --backend tcp --listen 10.0.0.1:7471   # on the offload host
  ofl probe --backend tcp --connect host:7471 [--connect host2:7471]
  ofl probe --loopback --backend tcp,shm                 # both ends on this machine
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

from . import env, probe
from .backends import NAMES
from .client import Connection
from .errors import OflError
from .region import Region
from .server import Server, parse_address

MiB = 1 << 20


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1, refused by argparse (exit 2) otherwise."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, not {text!r}")
    return int(text)


def shutdown_event() -> threading.Event:
    """Catch SIGTERM from now on. Servers call it before they print their ready line: a
    supervisor may stop them the moment it reads that line, and then they stop cleanly."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    return stop


def wait_for_shutdown(stop: threading.Event | None = None) -> None:
    """Block until SIGTERM (caught since `shutdown_event()`) or Ctrl-C (the servers' main thread)."""
    stop = stop or shutdown_event()
    try:
        while not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass


def emit_result(result: dict, out: str | None, as_json: bool, print_table) -> None:
    """The benches' ending: JSON to --out, then JSON or the table on stdout."""
    text = json.dumps(result, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    if as_json:
        print(text)
    else:
        print_table(result)


def cmd_serve(args) -> int:
    stop = shutdown_event()
    with ExitStack() as cleanup:  # also when a listener is refused: servers stop, then the region
        region = Region.allocate(probe.PROBE_REGION, args.size)
        cleanup.callback(region.close)
        servers = []
        for listen in args.listen:  # before the fill: a refused listener fails at once
            host, port = parse_address(listen, 7471)
            servers.append(Server(args.backend, host, port, identity=args.identity,
                                  handler=lambda b, _peer: b, insecure=args.insecure))
            cleanup.callback(servers[-1].stop)
        t = time.perf_counter()
        probe.fill(region)
        for srv in servers:
            srv.register(region)
            srv.start()
        addrs = ", ".join("%s:%d" % s.address for s in servers)
        print(f"ofl serve: {args.backend} on {addrs}, region {probe.PROBE_REGION!r} "
              f"{args.size / MiB:.0f} MiB (filled in {time.perf_counter() - t:.1f} s)", flush=True)
        wait_for_shutdown(stop)
    return 0


def run_probe(backend: str, addresses: list[str], args) -> dict:
    conns = [Connection(a, backend=backend, link=f"link{i}", identity="ofl-probe")
             for i, a in enumerate(addresses)]
    try:
        links = [probe.probe_link(c, size=args.size, reads=args.reads, small_reads=args.small_reads,
                                  messages=args.messages) for c in conns]
        agg = probe.probe_aggregate(conns, min(args.size, links[0].bytes_per_read), args.reads) \
            if len(conns) > 1 else None
    finally:
        for c in conns:
            c.close()
    return {"backend": backend, "links": [probe.as_dict(r) for r in links], "aggregate": agg}


def start_loopback_server(backend: str, size: int, **popen) -> tuple[subprocess.Popen, str]:
    """A real `ofl serve` process on 127.0.0.1 (`popen`: e.g. its env, stderr); returns it
    and its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ofl.cli", "serve", "--backend", backend, "--listen", "127.0.0.1:0",
         "--size", str(size)], stdout=subprocess.PIPE, text=True, **popen)
    line = proc.stdout.readline()
    if "ofl serve:" not in line:
        proc.kill()
        raise OflError(f"loopback server for {backend} did not start: {line!r}")
    address = line.split(" on ")[1].split(",")[0]
    return proc, address


def cmd_probe(args) -> int:
    results = []
    for backend in args.backend.split(","):
        if args.loopback:
            proc, address = start_loopback_server(backend, args.size)
            try:
                results.append(run_probe(backend, [address] * args.links, args))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=10)
        else:
            if not args.connect:
                print("ofl probe: give --connect HOST:PORT (once per link) or --loopback",
                      file=sys.stderr)
                return 2
            results.append(run_probe(backend, args.connect, args))
    if args.json:
        print(json.dumps({"probe": results}, indent=2))
    else:
        print_table(results)
    return 0


def print_table(results: list[dict]) -> None:
    head = (f"{'backend':8} {'link':7} {'address':21} {'read MiB':>8} {'Gb/s':>7} {'min':>7} "
            f"{'small p50':>10} {'p99 us':>8} {'msg p50':>8} {'p99 us':>8}")
    print(head)
    print("-" * len(head))
    for res in results:
        for r in res["links"]:
            print(f"{r['backend']:8} {r['link']:7} {r['address']:21} "
                  f"{r['bytes_per_read'] / MiB:8.0f} {r['gbit_s']:7.2f} {r['gbit_s_min']:7.2f} "
                  f"{r['small_p50_us']:10.1f} {r['small_p99_us']:8.1f} "
                  f"{r['message_p50_us']:8.1f} {r['message_p99_us']:8.1f}")
        agg = res["aggregate"]
        if agg:
            print(f"{res['backend']:8} {'all':7} {agg['links']} links at once{'':7} "
                  f"{'':8} {agg['gbit_s']:7.2f}")
    print("(every read verified against the server's pattern; Gb/s = 1e9 bit/s)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ofl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="publish a pattern-filled probe region and echo messages")
    s.add_argument("--backend", default=env.OFL_BACKEND.get(), choices=NAMES)
    s.add_argument("--listen", action="append", default=None,
                   help="HOST:PORT to listen on, once per link (default 127.0.0.1:7471)")
    s.add_argument("--size", type=parse_size, default=256 * MiB, help="probe region size (256MiB)")
    s.add_argument("--identity", default=f"ofl-serve@{os.uname().nodename}")
    s.add_argument("--insecure", action="store_const", const=True,
                   help="admit any peer on an address other hosts can reach with neither an "
                   "allow-list (OFL_ALLOW) nor a key (logged as a warning); default: OFL_INSECURE")
    s.set_defaults(func=cmd_serve)

    q = sub.add_parser("probe", help="measure read bandwidth, small-read latency, message RTT")
    q.add_argument("--backend", default=env.OFL_BACKEND.get(),
                   help="backend, or a comma list with --loopback (e.g. tcp,shm)")
    q.add_argument("--connect", action="append", default=[],
                   help="server HOST:PORT, once per link; links are probed alone, then at once")
    q.add_argument("--loopback", action="store_true",
                   help="start an `ofl serve` process on 127.0.0.1 for each backend and probe it")
    q.add_argument("--links", type=int, default=1, help="with --loopback: connections to open")
    q.add_argument("--size", type=parse_size, default=64 * MiB, help="bytes per read (64MiB)")
    q.add_argument("--reads", type=int, default=8, help="large reads per link (8)")
    q.add_argument("--small-reads", type=int, default=2000, help="264-byte reads for latency")
    q.add_argument("--messages", type=int, default=2000, help="64-byte echo round trips")
    q.add_argument("--json", action="store_true", help="print JSON instead of a table")
    q.set_defaults(func=cmd_probe)

    e = sub.add_parser("env", help="list the environment variables ofl reads")
    e.set_defaults(func=lambda a: print(env.describe()) or 0)

    args = p.parse_args(argv)
    if args.cmd == "serve" and not args.listen:
        args.listen = ["127.0.0.1:7471"]
    try:
        return args.func(args)
    except OflError as exc:
        print(f"ofl {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
