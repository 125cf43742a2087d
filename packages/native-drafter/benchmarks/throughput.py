"""Training throughput and the gate at the real shapes, before the real run (GPU tier).

A random target with SmolLM2-135M's shapes (30 layers, width 576, vocabulary 49,152) and
random tokens: the very train() the real run uses (gate, compiled fast path, optimiser),
for --minutes. Prints the gate table and anchors/s; writes JSON to --out.

  python packages/native-drafter/benchmarks/throughput.py --minutes 1 --out throughput.json
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

from native_drafter.train import TrainConfig, train
from remote_drafter.models.llama import LlamaConfig, random_llama

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, intermediate_size=1536, rms_norm_eps=1e-5, rope_theta=100000.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--anchors", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", default="throughput.json")
    args = p.parse_args()
    target = random_llama(SMOLLM2, seed=0, proj_std=0.02, embed_std=0.02).to(args.device)
    rng = np.random.default_rng(0)
    docs = rng.integers(0, SMOLLM2.vocab_size, 400_000).astype(np.uint16)
    offsets = np.arange(0, len(docs) + 1, 2000)
    cfg = TrainConfig(minutes=args.minutes, rows=args.rows, length=args.length, anchors=args.anchors,
                      compile=not args.no_compile)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out:
        fig = train(target, docs, offsets, docs[:40_000], offsets[:21], cfg, out,
                    {"target_digest": "random", "tokenizer_digest": "random"}, {"command": "throughput"},
                    device=args.device)
        size = os.path.getsize(os.path.join(out, "checkpoint", "drafter.safetensors"))
    fig.update(total_seconds=round(time.time() - t0, 1), checkpoint_bytes=size,
               max_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else 0)
    with open(args.out, "w") as f:
        json.dump(fig, f, indent=1)
    print(f"steps {fig['steps']}  anchors/s {fig['anchors_per_second']:,.0f}  tokens {fig['tokens_seen']:,}  "
          f"train {fig['train_seconds']} s  gate {fig['gate_seconds']} s  total {fig['total_seconds']} s  "
          f"checkpoint {size / 2**20:.1f} MiB  peak {fig['max_memory_gib']:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
