"""`python -m remote_drafter.bench [--device cpu|cuda] [--width tiny|smollm2] [--json]`:
draft-round latency and throughput, one run, every figure next to its baseline.

* rounds: the n-gram and the DSpark drafter (hidden-state mode, bf16 rows on the wire) at
  batch 1, 4, 16: a local call vs a remote worker over tcp (synchronous) vs the same worker
  through async_handoff's proxy. Per round: p50/p99 latency and drafts/s; for the async
  path also the time the engine is blocked when it collects after `--engine-ms` of other
  work (sync blocks for the whole round).
* spec_cache: a token-only drafter served over tcp, a target verifying for `--verify-ms`
  between rounds, cache off vs on: hit rate and round latency on hits and misses. Two
  drafters: the target's own copy (every round fully accepted: the cache's best case) and
  a random token-only DSpark drafter (almost never: its worst case).

Shapes: tiny (vocab 4096, width 64) for CPU machines; smollm2 (vocab 49,152, width 576,
3 drafter layers, 9/3 heads, FFN 1536, three target layers: the miniature's drafter).
Weights are random: this measures cost, not acceptance.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch

from ofl.cli import emit_result
from remote_drafter.decode_loop import speculative_decode
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.rows import DTYPES, cast
from remote_drafter.engine.transport import AsyncTransport, RemoteTransport
from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter
from remote_drafter.models.llama import LlamaConfig, random_llama
from remote_drafter.worker.server import spawn_worker
from remote_drafter.worker.shadow_parity import synthetic_prompts

WIDTHS = {
    "tiny": LlamaConfig(vocab_size=4096, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256),
    "smollm2": LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=4,
                            num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                            rope_theta=100000.0),
}


def make_models(base: str, width: str) -> dict:
    t = WIDTHS[width]
    paths = {n: os.path.join(base, n) for n in ("target", "dspark", "dspark-tokens")}
    random_llama(t, seed=0, proj_std=0.2 if width == "tiny" else 0.05).save(paths["target"])
    common = dict(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_heads=t.num_attention_heads,
                  num_kv_heads=t.num_key_value_heads, intermediate_size=t.intermediate_size,
                  mask_token_id=t.vocab_size - 1, rope_theta=t.rope_theta)
    DSparkDrafter.create(paths["dspark"], paths["target"], DSparkConfig(
        **common, target_layers=[1, 2, 3], target_hidden_size=t.hidden_size))
    DSparkDrafter.create(paths["dspark-tokens"], paths["target"], DSparkConfig(**common))
    return paths


class WorkerProc:
    def __init__(self, drafter: str, target: str, device: str, dtype: str, *extra):
        self.proc, self.address = spawn_worker(
            ["--drafter", drafter, "--target", target, "--device", device, "--dtype", dtype,
             "--listen", "127.0.0.1:0", *extra])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def percentiles(samples) -> dict:
    ms = np.asarray(samples) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def drive_rounds(client: DrafterClient, batch: int, rounds: int, k: int, vocab: int, feature: int,
                 mode: str, engine_s: float, seed: int = 0, row_dtype: str = "float32",
                 warm_rounds: int = 3, timing_starts=None) -> dict:
    """Open `batch` requests, then run `warm_rounds` untimed and `rounds` timed engine steps
    against a simulated target whose text repeats each prompt's closing phrase: a step
    commits the drafts that match it plus the target's next token (with random hidden rows
    when the drafter takes them, in `row_dtype`: a bf16 target's are bf16).
    A step is the engine's own work (`engine_s`) plus drafting: sync drafts after it,
    async submits before it and collects after it. Requests in service for a while (more
    warm rounds than a window's rows) hold recycled row blocks, touched before, where young
    ones still write into fresh memory. timing_starts(), if given, is called before the
    first timed round."""
    rng = np.random.default_rng(seed)
    prompts = synthetic_prompts(batch, vocab, 64, seed)

    def rows(n: int):
        return cast(rng.standard_normal((n, feature)).astype(np.float32), DTYPES[row_dtype]) if feature else None

    text = {rid: (p[-8:], 0) for rid, p in prompts.items()}  # (phrase, position in it)
    before = client.counters()  # a client that drove rounds before counts on from there
    for rid, p in prompts.items():
        client.add_request(rid, p, rows(len(p) - 1))
    steps, drafting, drafted = [], [], 0
    for i in range(rounds + warm_rounds):
        if i == warm_rounds:
            sent_before = client.counters()["request_bytes"]  # the timed rounds' bytes alone
            if timing_starts is not None:
                timing_starts()
        t0 = time.perf_counter()
        if mode == "async":
            client.submit(k)
            t1 = time.perf_counter()
            time.sleep(engine_s)
            t2 = time.perf_counter()
            drafts = client.collect()
            done = time.perf_counter()
            spent = (t1 - t0) + (done - t2)
        else:
            time.sleep(engine_s)
            t1 = time.perf_counter()
            drafts = client.propose(k)
            done = time.perf_counter()
            spent = done - t1
        if i >= warm_rounds:
            steps.append(done - t0)
            drafting.append(spent)
            drafted += sum(len(d.tokens) for d in drafts.values())
        for rid in prompts:
            phrase, at = text[rid]
            upcoming = [phrase[(at + j) % len(phrase)] for j in range(k + 1)]
            d = drafts.get(rid)
            a = 0
            while d is not None and a < len(d.tokens) and int(d.tokens[a]) == upcoming[a]:
                a += 1
            step = upcoming[:a + 1]
            text[rid] = (phrase, at + len(step))
            client.commit(rid, step, rows(len(step)))
    for rid in prompts:
        client.release(rid)
    return {"drafting": percentiles(drafting), "step_p50_ms": percentiles(steps)["p50_ms"],
            "drafts_per_s": drafted / sum(steps), "drafts_per_round": drafted / rounds,
            "request_bytes_per_round": (client.counters()["request_bytes"] - sent_before) / rounds,
            "rounds_failed": client.counters()["rounds_failed"] - before["rounds_failed"]}


def bench_rounds(paths, args, width) -> list[dict]:
    from async_handoff import HandoffConfig
    from remote_drafter.engine.transport import LocalTransport
    from remote_drafter.models.registry import load_drafter
    from remote_drafter.worker.service import DraftService, ServiceConfig
    t = WIDTHS[width]
    out = []
    expect = expectation(paths["target"], None)
    # slots hold a whole round: opens carry up to `window` hidden rows per request
    handoff = HandoffConfig(round_deadline_ms=2000, max_wait_ms=2000, startup_timeout_s=60,
                            slot_bytes=32 << 20)
    for name, spec, feature in (("ngram", "ngram", 0), ("dspark", paths["dspark"], 3 * t.hidden_size)):
        worker = WorkerProc(spec, paths["target"], args.device, args.dtype, "--max-requests", "64")
        local_drafter = load_drafter(spec, paths["target"], args.device)
        if args.dtype != "float32" and hasattr(local_drafter, "model"):
            local_drafter.model.to(getattr(torch, args.dtype))
        local_service = DraftService(local_drafter, ServiceConfig(max_requests=64))
        local_service.warm_up()
        try:
            for batch in args.batches:
                for via in ("local", "tcp", "async"):
                    if via == "local":
                        transport = LocalTransport(local_service)
                    elif via == "tcp":
                        transport = RemoteTransport(worker.address, "tcp", expect)
                    else:
                        transport = AsyncTransport(worker.address, "tcp", expect, handoff)
                    client = DrafterClient(transport, f"64:{args.k}", deadline_s=5.0, row_dtype="bfloat16")
                    mode = "async" if via == "async" else "sync"
                    alone = drive_rounds(client, batch, args.rounds, args.k, t.vocab_size, feature, mode, 0.0)
                    stepped = drive_rounds(client, batch, args.rounds, args.k, t.vocab_size, feature,
                                           mode, args.engine_ms / 1000, seed=1)
                    if via != "local":
                        client.close()
                    r = {"drafter": name, "via": via, "batch": batch, **alone["drafting"],
                         "drafts_per_s": alone["drafts_per_s"], "drafts_per_round": alone["drafts_per_round"],
                         "step_p50_ms": stepped["step_p50_ms"],
                         "step_drafting_p50_ms": stepped["drafting"]["p50_ms"],
                         "rounds_failed": stepped["rounds_failed"]}
                    out.append(r)
                    print("  " + row_text(r), file=sys.stderr, flush=True)
        finally:
            worker.stop()
    return out


def bench_spec_cache(paths, args, width) -> list[dict]:
    out = []
    target = random_llama(WIDTHS[width], seed=0, proj_std=0.2 if width == "tiny" else 0.05)
    target = target.to(args.device) if args.device != "cpu" else target
    expect = expectation(paths["target"], None)
    for name, spec in (("target-copy", "lm"), ("dspark-tokens", paths["dspark-tokens"])):
        for cache in (False, True):
            extra = ["--spec-cache", "--spec-cache-outcomes", str(args.outcomes),
                     "--spec-cache-max-batch", "4"] if cache else []  # b=4 rows use the cache too
            worker = WorkerProc(spec, paths["target"], args.device, "float32", *extra)
            try:
                for batch in (1, 4):
                    client = DrafterClient(RemoteTransport(worker.address, "tcp", expect),
                                           f"64:{args.k}", deadline_s=5.0)
                    hit_lat, miss_lat = [], []
                    real = client.propose

                    def timed(k=None, real=real, hit_lat=hit_lat, miss_lat=miss_lat):
                        t0 = time.perf_counter()
                        d = real(k)
                        dt = time.perf_counter() - t0
                        (hit_lat if d and all(x.cache_hit for x in d.values()) else miss_lat).append(dt)
                        return d
                    client.propose = timed
                    prompts = synthetic_prompts(batch, WIDTHS[width].vocab_size, 32, seed=batch)
                    with torch.inference_mode():
                        _run_decode(target, client, prompts, args)
                    c = client.counters()
                    row = {"drafter": name, "cache": cache, "batch": batch,
                           "rounds": len(hit_lat) + len(miss_lat),
                           "hit_rate": c["cache_hits"] / max(1, sum(1 for _ in hit_lat + miss_lat) * batch),
                           "hit": percentiles(hit_lat) if hit_lat else None,
                           "miss": percentiles(miss_lat) if miss_lat else None,
                           "all": percentiles(hit_lat + miss_lat)}
                    client.close()
                    out.append(row)
                    print(f"  cache {name:13s} {'on ' if cache else 'off'} batch {batch}: hit rate "
                          f"{row['hit_rate']:.2f}, round p50 {row['all']['p50_ms']:.2f} ms"
                          + (f" (hits {row['hit']['p50_ms']:.2f}, misses {row['miss']['p50_ms']:.2f})"
                             if row["hit"] and row["miss"] else ""), file=sys.stderr, flush=True)
            finally:
                worker.stop()
    return out


def _run_decode(target, client, prompts, args):
    """Greedy decoding with a target that 'verifies' for --verify-ms each step."""
    speculative_decode(target, client, prompts, args.tokens,
                       on_round=lambda d: time.sleep(args.verify_ms / 1000), k=args.k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m remote_drafter.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="drafter weights (the n-gram drafter has none)")
    ap.add_argument("--width", default="tiny", choices=sorted(WIDTHS))
    ap.add_argument("--batches", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--engine-ms", type=float, default=5.0,
                    help="async: the engine's own work between submit and collect")
    ap.add_argument("--verify-ms", type=float, default=20.0,
                    help="spec cache: the target's verification time between rounds")
    ap.add_argument("--outcomes", type=int, default=3, help="spec cache: outcomes per round")
    ap.add_argument("--tokens", type=int, default=48, help="spec cache: tokens per request")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: rounds, spec_cache")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as base:
        print(f"bench: writing {args.width} models ...", file=sys.stderr, flush=True)
        paths = make_models(base, args.width)
        result = {"device": args.device, "dtype": args.dtype, "width": args.width,
                  "torch": torch.__version__, "host": platform.node(), "k": args.k,
                  "engine_ms": args.engine_ms, "verify_ms": args.verify_ms,
                  "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
                  "round_bytes_per_token_bf16": 4 + 3 * WIDTHS[args.width].hidden_size * 2}
        if "rounds" not in args.skip:
            result["rounds"] = bench_rounds(paths, args, args.width)
        if "spec_cache" not in args.skip:
            result["spec_cache"] = bench_spec_cache(paths, args, args.width)
    emit_result(result, args.out, args.json, print_table)
    return 0


def row_text(x: dict) -> str:
    failed = f"  FAILED ROUNDS {x['rounds_failed']:.0f}" if x["rounds_failed"] else ""
    return (f"{x['drafter']:6s} {x['via']:5s} b={x['batch']:2d}  round p50 {x['p50_ms']:7.2f} "
            f"p99 {x['p99_ms']:7.2f} ms  {x['drafts_per_s']:8.0f} drafts/s  step {x['step_p50_ms']:6.2f} ms "
            f"(drafting {x['step_drafting_p50_ms']:5.2f}){failed}")


def print_table(r: dict) -> None:
    print(f"remote-drafter bench: {r['width']} on {r['device']} ({r['dtype']}), k={r['k']}, "
          f"{r['round_bytes_per_token_bf16']} B/token on the wire (bf16 rows); step = "
          f"{r['engine_ms']} ms engine work + drafting")
    for x in r.get("rounds", []):
        print("  " + row_text(x))
    for x in r.get("spec_cache", []):
        extra = (f"  hits {x['hit']['p50_ms']:.2f} / misses {x['miss']['p50_ms']:.2f} ms"
                 if x["hit"] and x["miss"] else "")
        print(f"  cache {x['drafter']:13s} {'on ' if x['cache'] else 'off'} b={x['batch']}  hit rate "
              f"{x['hit_rate']:.2f}  p50 {x['all']['p50_ms']:.2f} ms{extra}")


if __name__ == "__main__":
    sys.exit(main())
