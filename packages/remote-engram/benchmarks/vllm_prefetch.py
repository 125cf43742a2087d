"""What the Engram overlay's prefetch buys inside vLLM, with a slow link made on one machine.

  .venv/bin/python packages/remote-engram/benchmarks/vllm_prefetch.py \
      --python $(bash tools/vllm-cpu-env.sh) --out findings/raw/engram-prefetch.json

The SmolLM2 miniature (`remote-engram miniature --base`: Engram at layers 1 and 14) served by
vllm-cpu with its rows from a server that delays every read by --delay-ms; greedy
completions of --tokens tokens. Per setting: the median completion time and the engine's
own wait for rows per forward (the overlay's `overlay_wait_us` over `overlay_lookups`, both
layers together). Settings: no delay (the floor), delay with the fetch started at forward
entry (ENGRAM_PREFETCH=1, the default), delay with the fetch made when the layer needs its
rows (ENGRAM_PREFETCH=0). Writes JSON and prints a table.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from longctx_bench.launch import VllmServer, free_port
from remote_engram.client import served_counters
from remote_engram.testing import EngramServeProcess
from remote_engram.vllm.build_miniature import build

ROOT = Path(__file__).resolve().parents[3]

PROMPTS = ["The capital of Germany is", "def add(a, b):\n    return", "Once upon a time"]


def counters(port: int) -> dict:
    return served_counters(f"127.0.0.1:{port}")


def measure(args, model: Path, base: Path, name: str, delay_ms: float, prefetch: bool) -> dict:
    host = EngramServeProcess(str(model / "shards"), "tcp", delay_ms=delay_ms)
    port = free_port()
    env = {"ENGRAM_REMOTE": host.address, "ENGRAM_BACKEND": "tcp",
           "ENGRAM_SHARD_DIR": str(model / "shards"), "ENGRAM_DEADLINE_MS": "2000",
           "ENGRAM_PREFETCH": "1" if prefetch else "0",
           "ENGRAM_METRICS_LISTEN": f"127.0.0.1:{port}"}
    server = VllmServer(args.python, model, base / f"{name}.log", None, env, kv_bytes=1 << 28,
                        max_tokens=args.tokens)
    try:
        server.complete(PROMPTS[0], max_tokens=4)  # warm
        before, times, texts = counters(port), [], []
        for _ in range(args.repeats):
            for prompt in PROMPTS:
                t = time.perf_counter()
                texts.append(server.complete(prompt)["token_ids"])
                times.append(time.perf_counter() - t)
        after = counters(port)
    finally:
        server.stop()
        host.stop()
    lookups = after["overlay_lookups"] - before["overlay_lookups"]
    wait = (after["overlay_wait_us"] - before["overlay_wait_us"]) / 1e3
    return {"name": name, "delay_ms": delay_ms, "prefetch": prefetch,
            "completion_s_median": statistics.median(times),
            "wait_ms_per_forward": 2 * wait / lookups,  # two Engram layers per forward
            "lookups": lookups, "fallbacks": after.get("fallbacks", 0), "outputs": texts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", required=True, help="vLLM's interpreter (tools/vllm-cpu-env.sh)")
    p.add_argument("--smollm2", default=str(ROOT / ".artifacts/smollm2-135m"))
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="engram-prefetch-"))
    model = base / "smollm2-engram"
    build(str(model), args.smollm2, base=args.smollm2)
    results = [measure(args, model, base, "floor", 0.0, True),
               measure(args, model, base, "prefetch", args.delay_ms, True),
               measure(args, model, base, "on-demand", args.delay_ms, False)]
    same = all(r["outputs"] == results[0]["outputs"] for r in results)
    saved = results[2]["wait_ms_per_forward"] - results[1]["wait_ms_per_forward"]
    report = {"delay_ms": args.delay_ms, "tokens": args.tokens, "repeats": args.repeats,
              "outputs_identical": same, "wait_saved_ms_per_forward": saved,
              "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results]}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'setting':<10} {'delay':>6} {'completion':>11} {'wait/forward':>13} {'fallbacks':>9}")
    for r in results:
        print(f"{r['name']:<10} {r['delay_ms']:>4.0f}ms {r['completion_s_median']:>10.3f}s "
              f"{r['wait_ms_per_forward']:>11.2f}ms {r['fallbacks']:>9.0f}")
    print(f"prefetch saves {saved:.2f} ms of waiting per forward; outputs identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
