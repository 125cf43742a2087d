"""DeepSeek's drafter split by experts (kinds/dsv41.py), each rank's shard on one GPU as far as
one GPU allows: at the estimated V4.1-Flash width (remote-drafter's dsv41_gpu.FLASH, random
weights drawn on the card), rank 0's and then rank 1's shard (its half of every layer's routed
experts, half the embedding and head, the rest replicated), in bf16 and with CUDA graphs as
the pair serves it, but without its peer: the collectives are stood in for by local copies
(the MoE all-reduce adds nothing, the head's all-gather repeats this rank's half), so the
time is the rank's own compute. Per rank: the bytes of its weights on the card, its peak with
four sequences' windows against a 24 GB RTX 3090, and its round p50 / p99 at batch 1 / 4 / 16
against its floor (the bytes its round reads: its weights once but the gathered embedding
rows, of its routed experts only those the round chose; over the read bandwidth measured
in the same run). The pair itself over NCCL needs two GPUs (gpu.sh on nvidia-h200-x2).

    python packages/drafter-tp2-nvlink/benchmarks/dsv41_rank_gpu.py --out dsv41-rank.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "packages/remote-drafter/benchmarks"))
from dsv41_gpu import random_rounds, round_times, synchronize, width_config  # noqa: E402

from drafter_tp2 import sharding  # noqa: E402
from drafter_tp2.kinds.dsv41 import split  # noqa: E402
from drafter_tp2.sharding import Tally, bounds  # noqa: E402
from remote_drafter.engine.identity import Manifest  # noqa: E402
from remote_drafter.models.dsv41 import tiny  # noqa: E402
from remote_drafter.models.dsv41.config import markov_names, routed_expert, weight_table  # noqa: E402
from remote_drafter.models.dsv41.drafter import Dsv41Drafter  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402

GIB = 1 << 30
CARD_3090 = 24 * 10**9
W = ("w1", "w3", "w2")


class Alone:
    """torch.distributed's collectives for one rank without its peer: local stand-ins."""

    @staticmethod
    def all_reduce(t, group=None):
        return None

    @staticmethod
    def all_gather(parts, t, group=None):
        for p in parts:
            p.copy_(t)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def read_bandwidth(device: str, gib: float) -> float:
    """Bytes per second the device reads (a sum over a buffer far larger than its caches)."""
    x = torch.ones(int(gib * GIB) // 2, dtype=torch.half, device=device)
    times = []
    for _ in range(12):
        synchronize(device)
        t0 = time.perf_counter()
        x.sum(dtype=torch.float32)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return x.numel() * x.element_size() / sorted(times[2:])[len(times[2:]) // 2]


def rank_shard(rank: int, width: str, device: str) -> tuple[Dsv41Model, range, Tally]:
    config = width_config(width)
    held = range(*bounds(config.n_routed_experts, rank))
    gen = torch.Generator(device=device).manual_seed(rank)
    weights = {n: tiny.random_values(n, s, config, gen).to(torch.bfloat16)
               for n, (s, _) in weight_table(config, held).items()}
    model = Dsv41Model(config, weights, device, experts=held)
    del weights
    tally = Tally()
    return split(model, rank, None, tally), held, tally


def floor_of(drafter: Dsv41Drafter, sizes: dict, held: range, batch: int, bandwidth: float,
             tally: Tally) -> dict:
    """The bytes the rank's round reads, its chosen experts found by recording one eager round
    (and the collectives that round ran: a graph's replays run them unseen)."""
    before = tally.snapshot()
    chosen: dict[int, set] = {}
    model = drafter.model
    for j, layer in enumerate(model.layers):
        def recorded(x, j=j, route=layer.moe.route):
            weights, experts = route(x)
            chosen.setdefault(j, set()).update(e for e in experts.unique().tolist() if e in held)
            return weights, experts
        layer.moe.route = recorded
    try:
        drafter.draft(random_rounds(drafter, batch, 160, batch), want_probs=False)
    finally:
        for layer in model.layers:
            del layer.moe.route
    after = tally.snapshot()
    collectives = {n: {k: v[k] - before.get(n, {}).get(k, 0) for k in ("calls", "bytes")} for n, v in after.items()}
    gathered = {"embed.weight", markov_names(model.config)[0]}
    fixed = sum(b for n, b in sizes.items() if routed_expert(n) is None and n not in gathered)
    routed = sum(sizes[f"mtp.{j}.ffn.experts.{e}.{w}.weight"] for j, es in chosen.items() for e in es for w in W)
    return {"routed_expert_bytes": routed, "other_bytes": fixed, "floor_ms": round(1e3 * (routed + fixed) / bandwidth, 3),
            "collectives_per_round": collectives,
            "experts_chosen_per_layer": [len(chosen.get(j, ())) for j in range(model.config.n_mtp_layers)]}


def run(batches: list[int], rounds: int, width: str = "flash", device: str = "cuda") -> dict:
    """width "tiny" on the CPU: the smoke form (tests/test_tp2_dsv41.py)."""
    sharding.dist = Alone  # the collectives' local stand-ins (this process has no peer)
    cuda = device.startswith("cuda")
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "width": width, "batches": batches, "rounds": rounds, "card_3090_bytes": CARD_3090, "ranks": []}
    res["read_bandwidth_bytes_per_s"] = bandwidth = read_bandwidth(device, 4.0 if cuda else 0.25)
    say(f"== read bandwidth {bandwidth / 1e12:.2f} TB/s")
    manifest = Manifest(target="random-flash", tokenizer="random-flash", drafter="rank", markov="rank", kind="dsv41")
    for rank in (0, 1):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        model, held, tally = rank_shard(rank, width, device)
        sizes = {n: t.numel() * t.element_size() for n, t in model.named_tensors()}
        entry = {"rank": rank, "experts": [held.start, held.stop], "weight_bytes": sum(sizes.values())}
        say(f"== rank {rank}: experts {held.start}..{held.stop - 1}, weights {entry['weight_bytes'] / GIB:.2f} GiB")
        eager = Dsv41Drafter(model, manifest, device, cuda_graphs=False)
        floors = [floor_of(eager, sizes, held, b, bandwidth, tally) for b in batches]
        graphed = Dsv41Drafter(model, manifest, device, cuda_graphs=True)  # the CPU: eager
        entry["experts_path"], entry["round_kernels"] = graphed.experts, graphed.round_kernels
        entry["rounds"] = []
        for b, floor in zip(batches, floors):
            t = round_times(graphed, b, rounds)
            entry["rounds"].append({"batch": b, **t, **floor, "p50_over_floor": round(t["p50_ms"] / floor["floor_ms"], 1)})
            say(f"    batch {b}: p50 {t['p50_ms']:.2f} ms, p99 {t['p99_ms']:.2f} ms, floor {floor['floor_ms']:.3f} ms")
        graphed.draft(random_rounds(graphed, 4, 160, 0), want_probs=False)  # four sequences' windows
        if cuda:
            entry["peak_four_sequences_bytes"] = peak = torch.cuda.max_memory_allocated() - base
            entry["peak_of_3090"] = round(peak / CARD_3090, 3)
            say(f"    peak with four sequences' windows {peak / GIB:.2f} GiB ({entry['peak_of_3090']:.0%} of a 24 GB card)")
        res["ranks"].append(entry)
        del model, eager, graphed
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="dsv41-rank.json", help="JSON results (default: dsv41-rank.json)")
    ap.add_argument("--batches", default="1,4,16", help="requests per round (default: 1,4,16)")
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds per batch (default: 30)")
    ap.add_argument("--smoke", action="store_true", help="the tiny width on the CPU (tests)")
    args = ap.parse_args(argv)
    if not (args.smoke or torch.cuda.is_available()):
        print("dsv41_rank_gpu.py: needs a CUDA GPU (the GPU tier: gpu.sh), or --smoke", file=sys.stderr)
        return 2
    width, device = ("tiny", "cpu") if args.smoke else ("flash", "cuda")
    res = run([int(b) for b in args.batches.split(",")], args.rounds, width, device)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({r["rank"]: {"weights_gib": round(r["weight_bytes"] / GIB, 2),
                                  "peak_gib": round(r.get("peak_four_sequences_bytes", 0) / GIB, 2),
                                  "p50_ms": [x["p50_ms"] for x in r["rounds"]],
                                  "x_floor": [x["p50_over_floor"] for x in r["rounds"]]} for r in res["ranks"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
