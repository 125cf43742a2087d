"""The worker's own cost of a round, by phase: everything a round costs besides the drafter's
forward (protocol, row conversions, histories, per-request Python). By default (any CPU) with
a stub drafter whose `draft` returns fixed drafts at once and whose rows are as wide as
DeepSeek-V4.1-Flash's taps (3 x 4,096), so the payload is the production one (bf16 rows on
the wire). The rows bf16 from the engine to the worker's histories, as a bf16 target and
drafter keep them; then
float32 on both hosts, cast to bf16 for the wire and back (the baseline, in the same run).
Local (the service in process), a worker over tcp loopback in a thread of this process, and
one in its own process (as deployed: the engine's and the worker's Python never share a
lock), batch 1 / 4 / 16, each timed on its second pass (a worker and a client in service have
served requests before: memory they reuse is warm), with the requests young (three rounds
after they opened, their second row blocks still fresh memory) and in service (after two
windows of rounds, their row blocks recycled ones, as in a worker serving long requests:
dsv41_gpu.in_service), both in the same run; per phase the p50 over the timed rounds (the
worker's phases where it runs in this process); over tcp, beside it, the same payload's
round trip over a plain socket to a process of its own (the link's own time, ofl.bench's
baseline). Beside each own cost, the CPU time the client's thread spent in the round: in local
mode the whole round's (the service runs in that thread), a figure the machine's other work
does not move, where a wall-clock p50 on a small shared machine moves by tenths of it.

    python packages/remote-drafter/benchmarks/worker_cost.py --out worker-cost.json

The GPU script's figure (dsv41_gpu.measure: the tcp round minus the time inside `draft`) is the
same quantity with the real drafter; this one needs no GPU and says where it goes. With
--drafter flash (a GPU) the phases are timed around the random Flash-width drafter in bf16,
its rounds in CUDA graphs, as served (two such drafters, about 64 GB: this process's and the
worker process's). The own cost is the round less the time inside `draft`: the worker in its
own process borrows that time from the worker thread's row of the same batch and age (same
card, same graphs; `inside_draft_from` says so), since its status' draft percentiles mix
every batch it served. On the same host as the stub's figures, the two tell a slow host from
a cost the GPU brings."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import itertools
import json
import os
import resource
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ofl.bench import raw_message_round_trip
from ofl.channel import Channel
from ofl.server import Server

sys.path.insert(0, str(Path(__file__).parent))
from dsv41_gpu import in_service, random_drafter, random_rounds, round_options, worker_process  # noqa: E402

from remote_drafter.bench import drive_rounds  # noqa: E402
from remote_drafter.engine import client as client_module  # noqa: E402
from remote_drafter.engine import protocol  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.history import History  # noqa: E402
from remote_drafter.engine.identity import Manifest  # noqa: E402
from remote_drafter.engine.rows import DTYPES  # noqa: E402
from remote_drafter.engine.transport import LocalTransport, RemoteTransport  # noqa: E402
from remote_drafter.worker import service as service_module  # noqa: E402
from remote_drafter.worker.server import Worker  # noqa: E402
from remote_drafter.worker.service import DraftService, ServiceConfig  # noqa: E402

FLASH_FEATURE = 3 * 4096  # three tapped layers of a 4,096-wide stream
TURN = "worker: its whole turn (parse to encoded reply)"
PHASES = [  # (module or class, function, label): where a round's own time goes
    (client_module.DrafterClient, "_entries", "client: entries"),
    (protocol, "request_parts", "client: encode request"),
    (protocol, "parse_request", "worker: parse request"),
    (service_module, "all_finite", "worker: the round's rows checked finite"),
    (service_module.DraftService, "_apply", "worker: apply entries (histories)"),
    (service_module.DraftService, "_draft", "worker: draft and its replies (the time inside draft too)"),
    (protocol, "encode_reply", "worker: encode reply"),
    (protocol, "parse_reply", "client: parse reply"),
    (client_module.DrafterClient, "_absorb", "client: absorb replies"),
    (Channel, "recv_payload", "both: receive messages (waiting for their bytes too)"),
    (socket.socket, "sendmsg", "both: send system calls"),  # ofl's channels send with it
    (Server, "answer", TURN),
]
INSIDE_DRAFT = "worker: inside drafter.draft"  # not the worker's own cost: subtracted from the round


def outside_phases(phases: dict[str, float], own: float) -> float:
    """ms of the own cost no timed phase covers: over a link, the wake-ups and the server
    loop's and transport's Python (with the worker in its own process, its whole turn too).
    With the worker a thread of this process, phases of the two threads can overlap (the
    worker waits for bytes while the client sends them): there it is a lower bound."""
    worker = phases[TURN] if TURN in phases else sum(
        v for k, v in phases.items() if k.startswith("worker: ") and k != INSIDE_DRAFT)
    timed = worker - phases.get(INSIDE_DRAFT, 0.0) + sum(
        v for k, v in phases.items() if k.startswith(("client: ", "both: ")))
    return round(own - timed, 3)


class PhaseTimer:
    """Wraps each phase's function with a timer; once started, times[label] lists the seconds
    per call; with `faults`, faults[label] counts the minor page faults the process took
    meanwhile (fresh memory's first touches: a count no CPU's speed changes). Counting them
    is two system calls a phase, dear where system calls are (gVisor): off by default."""

    def __init__(self, drafter, faults: bool = False):
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self.faults: collections.Counter[str] = collections.Counter()
        self.on, self._count_faults = False, faults
        self._saved = []  # (owner, name, its own attribute before, or None: it inherited one)
        for owner, name, label in [*PHASES, (drafter, "draft", INSIDE_DRAFT)]:
            self._saved.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, self._wrap(getattr(owner, name), label))  # client and service call protocol.<f>

    def _wrap(self, f, label):
        def timed(*args, **kwargs):
            if not self.on:
                return f(*args, **kwargs)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt if self._count_faults else 0
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.times[label].append(time.perf_counter() - t0)
                if self._count_faults:
                    self.faults[label] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        return timed

    def start(self) -> None:
        self.on = True

    def per_round(self, rounds: int) -> dict[str, float]:
        """ms per round of each phase: its median call times its calls per round (_apply runs
        once per entry)."""
        return {label: round(float(np.median(samples)) * len(samples) / rounds * 1e3, 3)
                for label, samples in self.times.items()}

    def faults_per_round(self, rounds: int) -> dict[str, float]:
        return {label: round(n / rounds, 1) for label, n in self.faults.items()}

    def close(self) -> None:
        for owner, name, own in self._saved:
            if own is None:
                delattr(owner, name)  # what it inherits again (a class's method, _socket's sendmsg)
            else:
                setattr(owner, name, own)


SPIN_ENV = "WORKER_COST_SPIN_US"  # set by --spin-us while main runs; the worker process inherits it


def spinning(blocking, spin_s: float):
    """Channel._ready's wait (`blocking`, its function), after polls that do not block for up
    to `spin_s` of the wait: a thread that never sleeps, against one woken from sleep."""
    def ready(poller, seconds):
        end = time.perf_counter() + (spin_s if seconds is None else min(spin_s, seconds))
        while time.perf_counter() < end:
            if poller.poll(0):
                return True
        return blocking(poller, None if seconds is None else max(seconds - spin_s, 0.0))
    return ready


@contextlib.contextmanager
def spin_before_waits(spin_us: int):
    """Within it, every wait of ofl's channels in this process, and in the worker processes
    started meanwhile (SPIN_ENV), spins for up to `spin_us` µs before it blocks (an experiment:
    does the wake-up, not the work, cost on this host?); 0: as ofl waits."""
    if not spin_us:
        yield
        return
    if "_ready" not in vars(Channel):
        raise SystemExit("--spin-us: this ofl's channel has no _ready wait to spin before")
    blocking, env = vars(Channel)["_ready"], os.environ.get(SPIN_ENV)
    Channel._ready = staticmethod(spinning(blocking.__func__, spin_us * 1e-6))
    os.environ[SPIN_ENV] = str(spin_us)
    try:
        yield
    finally:
        Channel._ready = blocking
        if env is None:
            del os.environ[SPIN_ENV]
        else:
            os.environ[SPIN_ENV] = env


def thread_cpu(propose, samples: list):
    """`propose`, the CPU time this thread spends in each call appended to `samples`."""
    def timed(*args, **kwargs):
        started = time.thread_time()
        try:
            return propose(*args, **kwargs)
        finally:
            samples.append(time.thread_time() - started)
    return timed


def stub_drafter(rows: str):
    """The tiny random V4.1 drafter's fixed drafts, served as a drafter of Flash-wide rows
    that keeps them as `rows` (bfloat16: as the bf16 Flash drafter does)."""
    d, _ = random_drafter("tiny", "cpu", torch.float32)
    drafts = d.draft(random_rounds(d, 16, 40, 0), False)
    d.feature = FLASH_FEATURE
    d.draft = lambda requests, want_probs: drafts[:len(requests)]
    d.new_history = lambda: History(d.history_tokens, d.window, d.feature, DTYPES[rows])
    return d


def make_drafter(kind: str, row_dtype: str):
    """The stub; or (flash) the random Flash-width drafter in bf16 on the GPU, its rounds in
    CUDA graphs, as a worker serves it."""
    if kind == "flash":
        return random_drafter("flash", "cuda", torch.bfloat16, cuda_graphs=True)[0]
    return stub_drafter(row_dtype)


def serve(kind: str, row_dtype: str) -> None:
    """The worker in this process until stdin closes (the worker process of `main`)."""
    torch.set_num_threads(1)
    with spin_before_waits(int(os.environ.get(SPIN_ENV, "0"))), \
            Worker(make_drafter(kind, row_dtype), "tcp", "127.0.0.1", 0, ServiceConfig(max_requests=64)) as worker:
        print(worker.address, flush=True)
        sys.stdin.read()


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--serve"]:
        serve(*sys.argv[2:4])
        return 0
    ap = round_options(__doc__, "worker-cost.json", rounds=40)
    ap.add_argument("--drafter", default="stub", choices=["stub", "flash"],
                    help="stub: fixed drafts at once, no GPU; flash: the random Flash-width drafter "
                         "in bf16 on the GPU, in CUDA graphs (default: %(default)s)")
    ap.add_argument("--row-dtypes", default="bfloat16,float32", type=some_of("bfloat16", "float32"),
                    help="the hosts' row types to run: bfloat16 (end to end), float32 (cast for the wire "
                         "and back, the baseline); the Flash drafter keeps bfloat16 only (default: %(default)s)")
    ap.add_argument("--ages", default="young,in_service", type=some_of("young", "in_service"),
                    help="requests young (three rounds old) and/or in service (default: %(default)s)")
    ap.add_argument("--faults", action="store_true",
                    help="count each phase's minor page faults too (two system calls a phase)")
    ap.add_argument("--spin-us", type=non_negative, default=0,
                    help="every wait of the link, in both processes, polls without blocking for up to "
                         "this long before it blocks (an experiment; over tcp with the worker in a thread "
                         "the two threads' spins contend for the GIL: read tcp_process; the plain socket "
                         "beside it still blocks) (default: 0)")
    args = ap.parse_args(argv)
    if args.drafter == "flash" and not torch.cuda.is_available():
        ap.error("--drafter flash needs a CUDA GPU")
    with spin_before_waits(args.spin_us):
        return measure(args)


def some_of(*choices: str):
    """An option's type: a comma-separated list of `choices`, in their order."""
    def parse(text: str) -> list[str]:
        if not text or not set(picked := text.split(",")) <= set(choices):
            raise argparse.ArgumentTypeError(f"{text!r}: one or more of {', '.join(choices)}")
        return [c for c in choices if c in picked]
    return parse


def non_negative(text: str) -> int:
    if (n := int(text)) < 0:
        raise argparse.ArgumentTypeError(f"{n} is below 0")
    return n


def measure(args) -> int:
    """Every row (the module's doc says which), printed and written to args.out."""
    torch.set_num_threads(1)
    rows = []
    # bf16 rows from the engine to the histories (a bf16 target and drafter), then float32 rows
    # on both hosts (cast for the wire and back), the same bf16 on the wire both ways; the
    # Flash drafter keeps bf16 rows only
    for row_dtype in ("bfloat16",) if args.drafter == "flash" else args.row_dtypes:
        d = make_drafter(args.drafter, row_dtype)
        proc, apart = worker_process(__file__, args.drafter, row_dtype)
        inside = {}
        with Worker(d, "tcp", "127.0.0.1", 0, ServiceConfig(max_requests=64)) as worker, proc:
            for batch, age, via in itertools.product([int(b) for b in args.batches.split(",")],
                                                     args.ages, ("local", "tcp", "tcp_process")):
                transport = (LocalTransport(DraftService(d, ServiceConfig(max_requests=64))) if via == "local"
                             else RemoteTransport(worker.address if via == "tcp" else apart, "tcp", Manifest()))
                client = DrafterClient(transport, f"64:{d.max_depth}", deadline_s=30.0, row_dtype="bfloat16")
                timer, cpu = PhaseTimer(d, args.faults), []
                client.propose = thread_cpu(client.propose, cpu)
                drive = functools.partial(drive_rounds, client, batch, args.rounds, d.max_depth, d.vocab_size,
                                          d.feature, "sync", 0.0, seed=batch, row_dtype=row_dtype,
                                          warm_rounds=3 if age == "young" else in_service(d.window))
                try:  # the same requests twice, timed the second time (a worker in service has served)
                    drive()
                    r = drive(timing_starts=lambda timer=timer, cpu=cpu: (timer.start(), cpu.clear()))
                finally:
                    timer.close()
                    client.close()
                phases = timer.per_round(args.rounds)
                # the time inside `draft` is the device's (the stub's: next to none); a worker in
                # a process of its own drafts as long as the one in this process did for the
                # same batch and age (same card, same graphs)
                inside[batch, age] = phases.get(INSIDE_DRAFT, inside.get((batch, age), 0.0))
                rows.append({"rows": row_dtype, "batch": batch, "requests": age, "via": via,
                             "round_p50_ms": round(r["drafting"]["p50_ms"], 3),
                             "inside_draft_p50_ms": inside[batch, age],
                             "inside_draft_from": "this row" if INSIDE_DRAFT in phases
                             else "the worker thread's row of the same batch and age",
                             "own_p50_ms": round(r["drafting"]["p50_ms"] - inside[batch, age], 3),
                             # this thread's CPU time in the round: local, the whole own cost
                             # (the stub drafts in no time), steady whatever else the machine runs
                             "client_thread_cpu_p50_ms": round(float(np.median(cpu)) * 1e3, 3),
                             "request_bytes_per_round": int(r["request_bytes_per_round"]),
                             "phases_p50_ms": phases,
                             "outside_phases_ms": outside_phases(phases, r["drafting"]["p50_ms"] - inside[batch, age]),
                             **({"phases_page_faults_per_round": timer.faults_per_round(args.rounds)}
                                if args.faults else {})})
                if via != "local":  # the same payload over a plain socket: the link's own time
                    wire = raw_message_round_trip(r["request_bytes_per_round"], protocol.REPLY_HEADER.itemsize + batch * (
                        protocol.REPLY_ENTRY.itemsize + 4 * d.max_depth), args.rounds)["p50_ms"]
                    rows[-1].update(wire_p50_ms=round(wire, 3), own_beyond_wire_ms=round(rows[-1]["own_p50_ms"] - wire, 3))
                print(f"{row_dtype} rows, batch {batch:2d}, {age:10s} {via:11s}: own p50 {rows[-1]['own_p50_ms']:.3f} ms "
                      f"(this thread's CPU {rows[-1]['client_thread_cpu_p50_ms']:.3f}), "
                      f"{rows[-1]['request_bytes_per_round'] / 1e3:.0f} KB a round, "
                      f"outside the timed phases {rows[-1]['outside_phases_ms']:.3f} ms"
                      + (f", over a plain socket {wire:.3f} ms" if via != "local" else ""), flush=True)
    with open(args.out, "w") as f:
        json.dump({"drafter": args.drafter, "feature": FLASH_FEATURE, "rounds": args.rounds, "spin_us": args.spin_us,
                   "device": torch.cuda.get_device_name() if args.drafter == "flash" else "cpu",
                   "rows": rows}, f, indent=1)
    for r in rows:
        if r["via"] == "tcp":
            print(f"{r['rows']}, batch {r['batch']}, {r['requests']}, tcp: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["phases_p50_ms"].items()))
            if args.faults:
                print("    page faults a round: " + ", ".join(f"{k} {v:g}" for k, v in r["phases_page_faults_per_round"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
