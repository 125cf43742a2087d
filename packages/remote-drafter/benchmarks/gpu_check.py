"""GPU tier of remote-drafter (run by benchmarks/gpu.sh on an H200; never in CI).

At the miniature's drafter shape (width 576, 3 layers, vocab 49,152, three target layers,
window 128, W = 5): (1) CPU float32 vs CUDA float32 and bfloat16 drafts for the same
rounds at T = 0: token agreement, the block logits' relative error, and for every
disagreement the CPU's own top-2 probability gap there (near-ties flip; ARCHITECTURE.md § Exactness);
(2) draft-round device time at batch 1..64 (CUDA events, median of many rounds);
(3) greedy decoding of a random target on the GPU with the GPU drafter vs plain decoding.
Prints a table last and writes JSON (--out)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np
import torch

from remote_drafter.bench import WIDTHS, make_models
from remote_drafter.decode_loop import plain_decode, speculative_decode
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.transport import LocalTransport
from remote_drafter.models.base import DraftRequest
from remote_drafter.models.dspark import DSparkDrafter
from remote_drafter.models.llama import LlamaLM
from remote_drafter.testing import draft_agreement
from remote_drafter.worker.service import DraftService, ServiceConfig


def requests(drafter, batch: int, seed: int, depth: int = 5):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        n = int(rng.integers(20, 300))
        h = drafter.new_history()
        rows = rng.standard_normal((n - 1, drafter.feature)).astype(np.float32) if drafter.feature else None
        h.reset(rng.integers(0, drafter.vocab_size - 1, n).astype(np.int32), rows)
        out.append(DraftRequest(h, depth))
    return out


def block_logits(d, reqs):
    ctx, valid, pos = (torch.from_numpy(a).to(d.device) for a in d._context(reqs))
    anchor = torch.tensor([int(r.history.tokens[-1]) for r in reqs], device=d.device)
    anchor_pos = torch.tensor([r.history.length - 1 for r in reqs], device=d.device)
    with torch.inference_mode():
        return d.model.block_logits(ctx, valid, pos, anchor, anchor_pos).double().cpu()


def agreement(paths, name, dtype) -> dict:
    cpu = DSparkDrafter.load(paths[name], paths["target"], "cpu")
    gpu = DSparkDrafter.load(paths[name], paths["target"], "cuda", dtype=dtype)
    on_cpu, on_gpu, rel = [], [], []
    for seed in range(8):
        reqs = requests(cpu, 16, seed)
        on_cpu += cpu.draft(reqs, False)
        on_gpu += gpu.draft(reqs, False)
        za, zb = block_logits(cpu, reqs), block_logits(gpu, reqs)
        rel.append(float((za - zb).norm() / za.norm()))
    a = draft_agreement(on_cpu, on_gpu)
    total, same = a["requests"], a["same_greedy_drafts"]
    return {"drafter": name, "dtype": str(dtype).replace("torch.", ""), "rounds": total,
            "identical": same, "fraction": same / total, "logits_rel_err_max": max(rel),
            "top2_prob_gap_at_differences": sorted(a["top_two_gaps_where_they_part"])}


def timing(paths, name, dtype, batches, repeats=50) -> list[dict]:
    d = DSparkDrafter.load(paths[name], paths["target"], "cuda", dtype=dtype)
    out = []
    for batch in batches:
        reqs = requests(d, batch, 100 + batch)
        for _ in range(5):
            d.draft(reqs, False)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            d.draft(reqs, False)  # ends with the host copy of the drafts: a full round
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        p50 = float(np.median(times))
        out.append({"drafter": name, "dtype": str(dtype).replace("torch.", ""), "batch": batch,
                    "p50_ms": p50, "p99_ms": float(np.percentile(times, 99)),
                    "drafts_per_s": batch * 5 / (p50 / 1e3)})
    return out


def decode_check(paths, name) -> dict:
    target = LlamaLM.load(paths["target"], device="cuda")
    drafter = DSparkDrafter.load(paths[name], paths["target"], "cuda")
    prompts = {i: list(range(10 * i, 10 * i + 40)) for i in range(1, 5)}
    ref = {r: plain_decode(target, p, 48) for r, p in prompts.items()}
    client = DrafterClient(LocalTransport(DraftService(drafter, ServiceConfig())), "8:5")
    got = speculative_decode(target, client, prompts, 48, hidden_layers=drafter.hidden_layers)
    return {"drafter": name, "requests": len(prompts),
            "identical_requests": sum(got.tokens[r] == ref[r] for r in prompts),
            "mean_accepted_length": got.mean_accepted_length}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,4,16,64")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "shape": {"width": WIDTHS["smollm2"].hidden_size, "vocab": WIDTHS["smollm2"].vocab_size,
                        "layers": 3, "block": 5, "window": 128, "target_layers": 3}}
    with tempfile.TemporaryDirectory() as base:
        paths = make_models(base, "smollm2")
        result["agreement"] = [agreement(paths, n, dt) for n in ("dspark", "dspark-tokens")
                               for dt in (torch.float32, torch.bfloat16)]
        result["timing"] = [row for n in ("dspark", "dspark-tokens") for dt in (torch.float32, torch.bfloat16)
                            for row in timing(paths, n, dt, batches)]
        result["decode"] = [decode_check(paths, n) for n in ("dspark", "dspark-tokens")]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"GPU check on {result['gpu']} (torch {result['torch']})")
    for a in result["agreement"]:
        gaps = a["top2_prob_gap_at_differences"]
        print(f"  CPU f32 vs CUDA {a['dtype']:8s} {a['drafter']:13s}: {a['identical']}/{a['rounds']} rounds "
              f"identical, logits rel err {a['logits_rel_err_max']:.1e}"
              + (f", differences at top-2 gaps {', '.join(f'{g:.3f}' for g in gaps[:5])}" if gaps else ""))
    for t in result["timing"]:
        print(f"  round {t['drafter']:13s} {t['dtype']:8s} batch {t['batch']:3d}: p50 {t['p50_ms']:.3f} ms "
              f"p99 {t['p99_ms']:.3f} ms, {t['drafts_per_s']:,.0f} drafts/s")
    for d in result["decode"]:
        print(f"  decode on GPU with {d['drafter']}: {d['identical_requests']}/{d['requests']} requests equal "
              f"plain greedy, mean accepted length {d['mean_accepted_length']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
