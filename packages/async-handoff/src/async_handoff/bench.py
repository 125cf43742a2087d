"""`python -m async_handoff.bench [--json] [--out F]`: the handoff's round trip against
plain IPC, and the overlap it buys; one run, interleaved blocks, medians.

* An empty round between two processes through the host flags, in `spin` and `nap` mode
  (nap as configured by default: spin 50 us, then futex sleep; `nap_futex` spins 0 us, so
  every wait is a futex sleep and wake), against a multiprocessing.Pipe echo and a ZeroMQ
  REQ/REP echo over ipc://. Two levels: spin_/nap_/nap_futex_ = the flags themselves (both
  ends in C: hf_ping <-> hf_echo_serve); handoff_spin_/handoff_nap_ = the whole path
  (Handoff.submit/wait/poll in Python <-> the Python proxy with the NullAdapter).
  Keys *_p50_us and *_p99_us.
  Goals: spin p50 <= pipe p50 / 20, nap p50 <= pipe p50 / 2.
* Overlap: a simulated engine step (fixed CPU work) plus a remote round of fixed latency
  (an ofl worker that sleeps), synchronous (the round inside the step) vs through the
  handoff (submitted at the step's start, collected at its end): step-time p50 for each.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time

import numpy as np

from ofl.cli import emit_result

from . import __version__
from .handoff import Handoff, HandoffConfig

PAYLOAD = b"\0" * 64


def _pipe_echo(conn) -> None:
    while True:
        msg = conn.recv_bytes()
        if not msg:
            return
        conn.send_bytes(msg)


def _zmq_echo(address: str) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.REP)
    sock.bind(address)
    while True:
        msg = sock.recv()
        sock.send(msg)
        if msg == b"":
            return


def percentiles(samples: list[float]) -> tuple[float, float]:
    us = np.asarray(samples) * 1e6
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


def time_rounds(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


NAP_SPIN_NS = 50_000  # the default ASYNC_HANDOFF_SPIN_US


def _c_echo(path: str, generation: int, mode: int, spin_ns: int) -> None:
    from ._hostflags import lib
    from .hostflags import HostFlags

    flags = HostFlags.open(path)
    flags.set_proxy(os.getpid(), 1)
    lib.hf_echo_serve(flags.r, generation, mode, spin_ns, 2_000_000_000)


def flags_rounds(mode: str, spin_ns: int, n: int) -> list[float]:
    """Both ends in C: the cost of the flags alone."""
    from ._hostflags import ffi, lib
    from .hostflags import WAIT_MODES, HostFlags

    flags = HostFlags.create(f"ah-bench-{os.getpid()}-{time.monotonic_ns()}", 2, 4096)
    try:
        gen, _ = flags.new_generation()
        child = mp.get_context("spawn").Process(target=_c_echo, args=(flags.path, gen,
                                                                      WAIT_MODES[mode], spin_ns))
        child.start()
        while flags.info().proxy_pid != child.pid:
            time.sleep(0.005)
        rtt = ffi.new("int64_t[]", n + 200)
        rc = lib.hf_ping(flags.r, PAYLOAD, len(PAYLOAD), WAIT_MODES[mode], spin_ns, n + 200,
                         rtt)
        if rc:
            raise RuntimeError(f"hf_ping failed: {rc}")
        flags.new_generation()  # the echo peer sees the change and leaves
        child.join(10)
        return [x / 1e9 for x in list(rtt)[200:]]
    finally:
        flags.close(unlink=True)


def handoff_rounds(mode: str, n: int) -> list[float]:
    h = Handoff(HandoffConfig(mode=mode, spin_us=NAP_SPIN_NS / 1000, max_wait_ms=1000),
                "async_handoff.adapters:NullAdapter")
    h.start()
    try:
        def one():
            if h.wait(h.submit(PAYLOAD)) != PAYLOAD:
                raise RuntimeError(f"{mode}: a round failed")
        time_rounds(one, 200)  # warm
        return time_rounds(one, n)
    finally:
        h.close()


def bench_ipc(n: int, blocks: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    pipe_proc = ctx.Process(target=_pipe_echo, args=(child,), daemon=True)
    pipe_proc.start()
    samples = {"spin": [], "nap": [], "nap_futex": [], "handoff_spin": [], "handoff_nap": [],
               "pipe": [], "zmq": []}
    try:
        import zmq
    except ImportError:
        zmq = None
        samples.pop("zmq")
    with tempfile.TemporaryDirectory() as tmp:
        if zmq:
            address = f"ipc://{tmp}/echo"
            zmq_proc = ctx.Process(target=_zmq_echo, args=(address,), daemon=True)
            zmq_proc.start()
            req = zmq.Context().socket(zmq.REQ)
            req.connect(address)

        def pipe_one():
            parent.send_bytes(PAYLOAD)
            parent.recv_bytes()

        def zmq_one():
            req.send(PAYLOAD)
            req.recv()

        for _ in range(blocks):  # interleaved blocks, the order rotating
            for name in list(samples):
                if name in ("spin", "nap"):
                    samples[name] += flags_rounds(name, NAP_SPIN_NS, n)
                elif name == "nap_futex":
                    samples[name] += flags_rounds("nap", 0, n)
                elif name.startswith("handoff_"):
                    samples[name] += handoff_rounds(name.removeprefix("handoff_"), n)
                elif name == "pipe":
                    time_rounds(pipe_one, 200)
                    samples[name] += time_rounds(pipe_one, n)
                else:
                    time_rounds(zmq_one, 200)
                    samples[name] += time_rounds(zmq_one, n)
            samples = dict(list(samples.items())[1:] + list(samples.items())[:1])
        parent.send_bytes(b"")
        if zmq:
            req.send(b"")
            req.recv()
            zmq_proc.join(5)
    pipe_proc.join(5)
    out = {}
    for name, s in samples.items():
        out[f"{name}_p50_us"], out[f"{name}_p99_us"] = percentiles(s)
        out[f"{name}_rounds"] = len(s)
    return out


def _sleepy_worker(round_ms: float, ready) -> None:
    from ofl import Server
    from ofl.testing import link_delay

    def handler(payload: bytes, peer: str) -> bytes:
        link_delay(round_ms / 1000)
        return payload

    server = Server("tcp", handler=handler).start()
    ready.put("%s:%d" % server.address)
    while True:
        time.sleep(1)


def bench_overlap(work_ms: float, round_ms: float, steps: int) -> dict:
    """Step time: fixed CPU work + one remote round, sync vs through the handoff. The
    worker is its own process (a remote host's stand-in), so the engine's busy loop does
    not hold it up."""
    from ofl import Connection

    def work():
        end = time.perf_counter() + work_ms / 1000
        x = 0
        while time.perf_counter() < end:
            x += 1
        return x

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    worker = ctx.Process(target=_sleepy_worker, args=(round_ms, ready), daemon=True)
    worker.start()
    address = ready.get(timeout=30)
    conn = Connection(address, backend="tcp")
    h = Handoff(HandoffConfig(mode="nap", round_deadline_ms=10 * (work_ms + round_ms),
                              max_wait_ms=10 * (work_ms + round_ms)),
                "async_handoff.adapters:OflMessageAdapter", {"address": address, "backend": "tcp"})
    h.start()
    sync, overlapped, missed = [], [], 0
    try:
        for _ in range(steps):
            t = time.perf_counter()
            conn.request(PAYLOAD)
            work()
            sync.append(time.perf_counter() - t)
            t = time.perf_counter()
            ticket = h.submit(PAYLOAD)
            work()
            if h.wait(ticket) is None:
                missed += 1
            overlapped.append(time.perf_counter() - t)
    finally:
        h.close()
        conn.close()
        worker.kill()
    s50, a50 = float(np.median(sync)) * 1e3, float(np.median(overlapped)) * 1e3
    return {"work_ms": work_ms, "round_ms": round_ms, "steps": steps,
            "sync_step_p50_ms": s50, "async_step_p50_ms": a50, "async_over_sync": a50 / s50,
            "async_rounds_missed": missed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m async_handoff.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    p.add_argument("--rounds", type=int, default=2000, help="round trips per block (2000)")
    p.add_argument("--blocks", type=int, default=3, help="interleaved blocks (3)")
    p.add_argument("--work-ms", type=float, default=4.0, help="simulated step CPU work (4)")
    p.add_argument("--round-ms", type=float, default=2.0, help="simulated remote round (2)")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    ipc = bench_ipc(args.rounds, args.blocks)
    result = {"version": __version__, "host": platform.node(), "cpus": os.cpu_count(), **ipc,
              "spin_over_pipe": ipc["spin_p50_us"] / ipc["pipe_p50_us"],
              "nap_over_pipe": ipc["nap_p50_us"] / ipc["pipe_p50_us"],
              "nap_futex_over_pipe": ipc["nap_futex_p50_us"] / ipc["pipe_p50_us"],
              "handoff_spin_over_pipe": ipc["handoff_spin_p50_us"] / ipc["pipe_p50_us"],
              "handoff_nap_over_pipe": ipc["handoff_nap_p50_us"] / ipc["pipe_p50_us"],
              "goals": {"spin_over_pipe": 1 / 20, "nap_over_pipe": 1 / 2},
              "overlap": bench_overlap(args.work_ms, args.round_ms, args.steps)}
    emit_result(result, args.out, args.json, print_table)
    return 0


def print_table(result: dict) -> None:
    print(f"{'empty round, 2 processes':26} {'p50 us':>8} {'p99 us':>8}")
    for name in ("spin", "nap", "nap_futex", "handoff_spin", "handoff_nap", "pipe", "zmq"):
        if f"{name}_p50_us" in result:
            print(f"{name:26} {result[f'{name}_p50_us']:8.1f} {result[f'{name}_p99_us']:8.1f}")
    print(f"flags:   spin/pipe {result['spin_over_pipe']:.3f} (goal <= 0.05), nap/pipe "
          f"{result['nap_over_pipe']:.3f} (goal <= 0.5)")
    print(f"handoff: spin/pipe {result['handoff_spin_over_pipe']:.3f}, nap/pipe "
          f"{result['handoff_nap_over_pipe']:.3f}")
    o = result["overlap"]
    print(f"step = {o['work_ms']} ms work + {o['round_ms']} ms round: sync p50 "
          f"{o['sync_step_p50_ms']:.2f} ms, async p50 {o['async_step_p50_ms']:.2f} ms "
          f"({o['async_over_sync']:.2f}x), {o['async_rounds_missed']} rounds missed")


if __name__ == "__main__":
    sys.exit(main())
