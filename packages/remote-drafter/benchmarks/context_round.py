"""CPU micro-benchmark of the worker's DSpark round at the production-like drafter width's
context (3 target layers x 7168 = 21,504 floats per hidden row, window 128) with a small
model (width 32): what the host does per round (parse, histories, context assembly,
copies), not the model.

  .venv/bin/python packages/remote-drafter/benchmarks/context_round.py [--baseline REV]
      [--batches 1,4,16] [--rounds 30] [--out F] [--json]

Each of `batch` requests is opened with 128 hidden rows, then every round commits one token
and its hidden row per request and asks for 5 drafts (bf16 rows on the wire), in one
DraftService.handle call, as the worker runs it (no link). `model` is the time spent inside
DSparkModel.block_logits; `host` is the rest of the round (p50s over the rounds). With
--baseline REV the same measurement first runs on REV's remote_drafter (its source from
`git archive`, in a child process), and the table gives both and the ratio before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch

from ofl.cli import emit_result
from remote_drafter.engine import protocol as P
from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter
from remote_drafter.models.llama import LlamaConfig, random_llama
from remote_drafter.worker.service import DraftService, ServiceConfig

TARGET = LlamaConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64)
TARGET_HIDDEN, TARGET_LAYERS, WINDOW, K = 7168, [1, 2, 3], 128, 5
FEATURE = TARGET_HIDDEN * len(TARGET_LAYERS)
SRC = "packages/remote-drafter/src"


def measure(batches: list[int], rounds: int) -> dict:
    """Round, model and host p50 (ms) per batch size, on the remote_drafter imported."""
    with tempfile.TemporaryDirectory() as base:
        target, path = os.path.join(base, "target"), os.path.join(base, "dspark")
        random_llama(TARGET, seed=0).save(target)
        DSparkDrafter.create(path, target, DSparkConfig(
            vocab_size=TARGET.vocab_size, hidden_size=TARGET.hidden_size, num_heads=4,
            num_kv_heads=2, intermediate_size=64, window=WINDOW, mask_token_id=TARGET.vocab_size - 1,
            target_layers=TARGET_LAYERS, target_hidden_size=TARGET_HIDDEN))
        drafter = DSparkDrafter.load(path, target)
    model_s = []
    block_logits = drafter.model.block_logits

    def timed(*inputs):
        t0 = time.perf_counter()
        z = block_logits(*inputs)
        model_s.append(time.perf_counter() - t0)
        return z
    drafter.model.block_logits = timed
    rng = np.random.default_rng(0)
    rows = lambda n: rng.standard_normal((n, FEATURE)).astype(np.float32)  # noqa: E731
    out = []
    for batch in batches:
        service = DraftService(drafter, ServiceConfig(max_requests=batch))
        fp, length = service.fingerprint, 200
        tokens = lambda n: rng.integers(0, TARGET.vocab_size, n).astype(np.int32)  # noqa: E731
        service.handle(P.encode_request(
            [P.Entry(rid, P.OP_OPEN, tokens(length), rows(WINDOW), K, feature=FEATURE, length=length)
             for rid in range(batch)], fp, "bfloat16"))
        round_s, model_s[:] = [], []
        for _ in range(rounds + 3):  # the first three warm up
            length += 1
            payload = P.encode_request(
                [P.Entry(rid, P.OP_CONTINUE, tokens(1), rows(1), K, feature=FEATURE, length=length)
                 for rid in range(batch)], fp, "bfloat16")
            t0 = time.perf_counter()
            replies = P.parse_reply(service.handle(payload))
            round_s.append(time.perf_counter() - t0)
            assert all(r.ok and len(r.tokens) == K for r in replies), replies
        round_s, model = np.array(round_s[3:]), np.array(model_s[3:])
        out.append({"batch": batch, "round_p50_ms": 1e3 * float(np.median(round_s)),
                    "model_p50_ms": 1e3 * float(np.median(model)),
                    "host_p50_ms": 1e3 * float(np.median(round_s - model))})
        print(f"  batch {batch:2d}: round p50 {out[-1]['round_p50_ms']:7.2f} ms, host "
              f"{out[-1]['host_p50_ms']:7.2f} ms", file=sys.stderr, flush=True)
    return {"rows": out, "remote_drafter": os.path.dirname(os.path.abspath(P.__file__))}


def baseline(rev: str, args) -> dict:
    """The same measurement on `rev`'s remote_drafter, in a child process."""
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", rev], capture_output=True, text=True, check=True,
                            cwd=repo).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", commit, SRC], capture_output=True, check=True,
                                 cwd=repo).stdout
        with open(os.path.join(tmp, "src.tar"), "wb") as f:
            f.write(archive)
        with tarfile.open(os.path.join(tmp, "src.tar")) as tar:
            tar.extractall(tmp, filter="data")
        env = dict(os.environ, PYTHONPATH=os.path.join(tmp, SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", "--batches",
                                ",".join(map(str, args.batches)), "--rounds", str(args.rounds),
                                "--threads", str(args.threads)],
                               env=env, capture_output=True, text=True, check=True)
    result = json.loads(child.stdout)
    return {**result, "commit": commit}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: steadier on a small shared machine)")
    ap.add_argument("--baseline", default=None, help="a git revision to measure first, e.g. HEAD~1")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    result = {"feature": FEATURE, "window": WINDOW, "k": K, "model_width": TARGET.hidden_size,
              "torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count(),
              "threads": torch.get_num_threads()}
    if args.baseline:
        print(f"before ({args.baseline}):", file=sys.stderr, flush=True)
        result["before"] = baseline(args.baseline, args)
        print("after (this tree):", file=sys.stderr, flush=True)
    result.update(measure(args.batches, args.rounds))
    emit_result(result, args.out, args.json, print_table)
    return 0


def print_table(r: dict) -> None:
    before = {x["batch"]: x for x in r.get("before", {}).get("rows", [])}
    print(f"DSpark worker round on the CPU: feature {r['feature']} x window {r['window']}, "
          f"model width {r['model_width']}, k={r['k']} ({r['threads']} threads); p50 ms")
    if before:
        print(f"  before = {r['before']['commit'][:10]}, after = this tree")
        print("  batch  round before  after  ratio   host before  after  ratio   model")
    else:
        print("  batch   round    host   model")
    for x in r["rows"]:
        b = before.get(x["batch"])
        if b:
            print(f"  {x['batch']:5d}  {b['round_p50_ms']:12.2f} {x['round_p50_ms']:6.2f} "
                  f"{b['round_p50_ms'] / x['round_p50_ms']:5.1f}x  {b['host_p50_ms']:11.2f} "
                  f"{x['host_p50_ms']:6.2f} {b['host_p50_ms'] / x['host_p50_ms']:5.1f}x  "
                  f"{x['model_p50_ms']:6.2f}")
        else:
            print(f"  {x['batch']:5d}  {x['round_p50_ms']:6.2f}  {x['host_p50_ms']:6.2f}  "
                  f"{x['model_p50_ms']:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
