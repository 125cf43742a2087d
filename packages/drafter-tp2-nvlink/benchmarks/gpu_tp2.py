"""GPU tier of drafter-tp2 (benchmarks/gpu.sh runs it on an nvidia-h200-x2 machine): pair
check and P2P status, graph capture, TP2 vs one-card drafts on CUDA, the fault drill, and
client round latency at batch 1/4/16 for one-card vs TP2 (graphs) vs TP2 (eager), with
memory per card, at two drafter widths:

* smollm2: the SmolLM2-135M miniature's drafter (hidden 576, 9 heads / 3 kv heads, ffn
  1536, vocabulary 49,152, tied head), float32 and 3 layers, W = 5, window 128.
* large: a width resembling the production drafter's (hidden 7168, 56 heads / 8 kv heads,
  ffn 18432, vocabulary 129,280, untied head, bfloat16; ~7.4 GiB, the reference's one-card
  drafter took ~8.1 GiB), same 3 layers, W = 5, window 128.

Weights are random (latency and parity do not depend on training). With one GPU only the
one-card half runs (the TP2 columns say "not run: needs two GPUs"). Prints a table, writes
JSON (--out)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import numpy as np
import torch

from drafter_tp2.parity import compare_single_rounds
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation, target_digest, tokenizer_digest
from remote_drafter.engine.transport import RemoteTransport
from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter, DSparkModel, init_weights
from remote_drafter.models.llama import LlamaConfig, random_llama
from remote_drafter.models.registry import load_drafter
from remote_drafter.worker.server import spawn_worker

WIDTHS = {
    "smollm2": dict(target=LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=1,
                                        num_attention_heads=9, num_key_value_heads=3,
                                        intermediate_size=1536),
                    dtype="float32"),
    "large": dict(target=LlamaConfig(vocab_size=129280, hidden_size=7168, num_hidden_layers=1,
                                      num_attention_heads=56, num_key_value_heads=8,
                                      intermediate_size=18432, tie_word_embeddings=False),
                  dtype="bfloat16"),
}
BATCHES = (1, 4, 16)


def build(base: str, name: str) -> tuple[str, str]:
    """A random target (one layer: only its embedding and head matter here) and a random
    hidden-state DSpark drafter at that width, saved in the width's dtype."""
    t = WIDTHS[name]["target"]
    target, drafter = os.path.join(base, name, "target"), os.path.join(base, name, "dspark")
    random_llama(t, seed=0).save(target)
    config = DSparkConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=3,
                          num_heads=t.num_attention_heads, num_kv_heads=t.num_key_value_heads,
                          intermediate_size=t.intermediate_size, window=128,
                          target_layers=[0, 0, 0], target_hidden_size=t.hidden_size,
                          mask_token_id=t.vocab_size - 1)
    embed = torch.randn(t.vocab_size, t.hidden_size)  # shape only: the saved drafter never stores it
    model = init_weights(DSparkModel(config, embed, embed), seed=0)
    DSparkDrafter.save(drafter, model, target_digest(target), tokenizer_digest(target),
                       dtype=getattr(torch, WIDTHS[name]["dtype"]))
    return target, drafter


def start_tp2(drafter: str, target: str, dtype: str, graphs: bool) -> tuple[subprocess.Popen, str, list[int]]:
    env = {**os.environ, "DRAFTER_TP2_CUDA_GRAPHS": "auto" if graphs else "0"}
    proc = subprocess.Popen([sys.executable, "-m", "drafter_tp2.cli", "worker", "--drafter", drafter,
                             "--target", target, "--devices", "cuda:0,cuda:1", "--dtype", dtype,
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if " on " not in line:
        proc.wait()
        raise RuntimeError(f"the TP2 worker did not start: {line!r}")
    pids = [int(p) for p in line.split("rank pids ", 1)[1].split(")", 1)[0].split(",")]
    return proc, line.rsplit(" on ", 1)[1].strip(), pids


def memory_mib(pids: list[int]) -> dict:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        pid, uuid, used = [x.strip() for x in line.split(",")]
        if pid.isdigit() and int(pid) in pids:
            found[f"pid {pid} ({uuid[:12]})"] = int(used) if used.isdigit() else used
    return found


def client(address: str, target: str) -> DrafterClient:
    return DrafterClient(RemoteTransport(address, "tcp", expectation(target, None)), "64:5",
                         deadline_s=5.0)


def time_rounds(address: str, target: str, feature: int, vocab: int, batch: int, rounds: int) -> dict:
    """Client round time with `batch` requests continuing one token per round (the steady
    decode shape: one new token and its hidden row per request)."""
    c = client(address, target)
    rng = np.random.default_rng(0)
    for rid in range(batch):
        c.add_request(rid, rng.integers(0, vocab - 1, 200), rng.standard_normal((199, feature)).astype(np.float32))
    times, warm = [], 0
    for i in range(rounds + 1000):
        t0 = time.perf_counter()
        drafts = c.propose()
        elapsed = time.perf_counter() - t0
        # Warm-up: the opens (200 rows each) spread over rounds as the link's round size
        # allows; timing starts after 5 rounds in which every request was drafted.
        if len(drafts) == batch and warm >= 5:
            times.append(elapsed)
        elif warm >= 5:
            raise RuntimeError(f"round {i}: {len(drafts)} of {batch} requests drafted")
        warm += len(drafts) == batch
        if len(times) == rounds:
            break
        for rid in range(batch):
            c.commit(rid, [int(rng.integers(0, vocab - 1))], rng.standard_normal((1, feature)).astype(np.float32))
    if len(times) < rounds:
        raise RuntimeError(f"batch {batch}: never drafted every request in one round")
    for rid in range(batch):
        c.release(rid)
    c.propose()
    ms = np.array(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "rounds": rounds}


def parity(address: str, target: str, drafter: str, rounds: int, device: str = "cuda:0") -> dict:
    """TP2 drafts vs the one-card drafter on `device` (float32), single-request rounds."""
    return compare_single_rounds(client(address, target), load_drafter(drafter, target, device),
                                 rounds, 200, seed=7)


def fault_drill(drafter: str, target: str, dtype: str) -> dict:
    proc, address, pids = start_tp2(drafter, target, dtype, graphs=True)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code = proc.wait(timeout=120)
    return {"killed": "rank 1", "pair_exit": code, "seconds_to_stop": time.monotonic() - t0}


def measure(name: str, base: str, rounds: int) -> dict:
    target, drafter = build(base, name)
    dtype = WIDTHS[name]["dtype"]
    feature, vocab = 3 * WIDTHS[name]["target"].hidden_size, WIDTHS[name]["target"].vocab_size
    result = {"width": name, "dtype": dtype, "config": asdict(WIDTHS[name]["target"]), "latency": {}}
    one, one_address = spawn_worker(["--drafter", drafter, "--target", target, "--device", "cuda:0",
                                     "--dtype", dtype, "--listen", "127.0.0.1:0"])
    try:
        result["memory_one_card_mib"] = memory_mib([one.pid])
        result["latency"]["one-card"] = {b: time_rounds(one_address, target, feature, vocab, b, rounds) for b in BATCHES}
    finally:
        one.terminate()
        one.wait()
    if torch.cuda.device_count() < 2:
        result["tp2"] = f"not run: needs two GPUs, this machine has {torch.cuda.device_count()}"
        return result
    for graphs in (True, False):
        label = "tp2-graphs" if graphs else "tp2-eager"
        proc, address, pids = start_tp2(drafter, target, dtype, graphs)
        try:
            c = client(address, target)
            result[f"{label}_topology"] = c.transport.info(10).described["drafter"]["topology"]
            c.close()
            result[f"memory_{label}_mib"] = memory_mib(pids)
            result["latency"][label] = {b: time_rounds(address, target, feature, vocab, b, rounds) for b in BATCHES}
            if name == "smollm2":
                result[f"parity_{label}"] = parity(address, target, drafter, 100)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    result["fault_drill"] = fault_drill(drafter, target, dtype)
    return result


def print_table(results: list[dict]) -> None:
    print(f"{'width':8} {'worker':11} " + " ".join(f"b={b:<2} p50/p99 ms " for b in BATCHES))
    for r in results:
        for label, per in r["latency"].items():
            print(f"{r['width']:8} {label:11} " + " ".join(
                f"{per[b]['p50_ms']:6.2f}/{per[b]['p99_ms']:6.2f}   " for b in BATCHES))
        print(f"{r['width']:8} memory: one-card {r['memory_one_card_mib']}, "
              f"tp2 {r.get('memory_tp2-graphs_mib', r.get('tp2'))}")
        for label in ("tp2-graphs", "tp2-eager"):
            p = r.get(f"parity_{label}")
            if p:
                print(f"{r['width']:8} parity {label} vs one-card: {p['identical']}/{p['rounds']} "
                      f"(gaps {p['difference_top2_gaps']})")
        if "tp2" in r:
            print(f"{r['width']:8} TP2 {r['tp2']}")
            continue
        print(f"{r['width']:8} topology: {r['tp2-graphs_topology']}")
        print(f"{r['width']:8} fault drill: {r['fault_drill']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="smollm2,large")
    ap.add_argument("--rounds", type=int, default=100, help="timed rounds per batch size")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_tp2: needs a CUDA device (two for the TP2 half)", file=sys.stderr)
        return 2
    # An open carries the window's hidden rows: 128 x 3 x 7168 float32 = 11 MB at the large
    # width, over ofl's 4 MiB default message (workers inherit this; the engine side of a
    # deployment at that width needs the same setting).
    os.environ.setdefault("OFL_MAX_MESSAGE_BYTES", str(32 << 20))
    results = []
    with tempfile.TemporaryDirectory() as base:
        for name in args.widths.split(","):  # each width's figures kept as soon as they exist
            results.append(measure(name, base, args.rounds))
            print_table(results[-1:])
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
