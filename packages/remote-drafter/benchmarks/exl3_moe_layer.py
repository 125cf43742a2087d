"""One DeepSeek drafter MoE layer in EXL3 at the estimated V4.1-Flash width (dsv41_gpu.FLASH:
192 routed experts of 4096 -> 2048 -> 4096, top 8, one shared expert; random 4-bit mul1 trellis)
on a GPU: our kernel (models/exl3_triton_experts.py: each chosen expert decoded once for all
its rows) against exllamav3's fused kernels (models/exl3_experts.Exl3Experts: the coop tier
decodes an expert once per slot up to 256 slots), on the same tensors and rows, in CUDA graphs.

Rows 5 / 20 / 80 (a block of W = 5 rows at batch 1 / 4 / 16), each row choosing 8 distinct
experts among the number a Flash-width round chose at that batch (16 / 40 / 92, the floors of
drafter_round.py). Per row count: ours tuned as a worker tunes it (TritonExl3Experts.tune: the
fastest of its CONFIGS, each one's time kept, and the seconds the tuning took: the first row
count's include compiling the kernels; its plan's kernel and torch's sort each timed alone)
and timed again, the whole layer with each plan too, and its three grouped products
alone (as the layer splits the input, and split 1 to 16 ways);
exllamav3's (when it loads); their relative difference; and the bytes of trellis the call must
read (each chosen expert once and the shared one) over each time.
Prints a line per row count and writes JSON (--out); `--compare` sets runs by the code
before a change and after it side by side (gpu.sh ONLY_DRAFTER_ROUND=moe-before-after).

    source tools/gpu-env.sh .whl   # exllamav3 1.6.5 and its needs for its side (else ours alone)
    python3 packages/remote-drafter/benchmarks/exl3_moe_layer.py --out exl3-moe-layer.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from dsv41_gpu import FLASH  # noqa: E402
from round_phases import CHOSEN_SLOTS, in_graph  # noqa: E402

from remote_drafter.models import exl3, exl3_triton  # noqa: E402
from remote_drafter.models.exl3_triton_experts import Stored, TritonExl3Experts  # noqa: E402

# rows -> the experts a Flash-width round chose (batch 1 / 4 / 16 at top 8)
CHOSEN = {slots // FLASH["dspark_num_experts_per_tok"]: chosen for chosen, slots in CHOSEN_SLOTS.values()}
LIMIT = 10.0  # DeepSeek-V4's swiglu_limit
SPLITS = (1, 2, 4, 8, 16)  # the products' input splits timed beside the layer's own choice


def random_stored(n_in: int, n_out: int, gen, bits: int = exl3_triton.BITS, device: str = "cuda") -> Stored:
    """An EXL3 linear of n_in x n_out (multiples of 16) with random trellis bytes (every pattern is
    a valid trellis), suh signs and svh signs over sqrt(n_in), on `device` (gen's): timing and
    counting only."""
    trellis = torch.randint(-2**15, 2**15, (n_in // 16, n_out // 16, 16 * bits), dtype=torch.int16,
                            device=device, generator=gen)
    suh = (torch.randint(0, 2, (n_in,), device=device, generator=gen) * 2 - 1).half()
    svh = ((torch.randint(0, 2, (n_out,), device=device, generator=gen) * 2 - 1) * n_in ** -0.5).half()
    return Stored(trellis, suh, svh)


def exl3_linear(s: Stored, n_in: int | None = None, n_out: int | None = None) -> exl3.Exl3Linear:
    """exllamav3's linear over s's tensors (no copy), serving n_in x n_out of them (default all)."""
    from exllamav3.modules.quant.exl3_lib.quantize import codebook_markers
    stored_in, stored_out = s.trellis.shape[0] * 16, s.trellis.shape[1] * 16
    return exl3.Exl3Linear({"trellis": s.trellis, "suh": s.suh, "svh": s.svh, **codebook_markers({"mul1": True})},
                           n_in or stored_in, n_out or stored_out, "cuda")


def exllamav3_layer(routed, shared, top_k: int):
    """exllamav3's fused kernels over the same tensors (Exl3Linears wrap them, no copy)."""
    from remote_drafter.models.exl3_experts import Exl3Experts
    return Exl3Experts([tuple(exl3_linear(s) for s in e) for e in routed], tuple(exl3_linear(s) for s in shared),
                       top_k, LIMIT, "cuda")


def routing(rows: int, chosen: int, experts: int, top_k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k distinct experts among `chosen` of them, and softmax-like weights."""
    pool = torch.randperm(experts, generator=gen, device="cpu")[:chosen]
    picks = torch.stack([pool[torch.randperm(chosen, generator=gen)[:top_k]] for _ in range(rows)])
    weights = torch.rand(rows, top_k, generator=gen).softmax(-1)
    return weights.cuda(), picks.cuda()


def products_only(moe: TritonExl3Experts, x, weights, experts, splits: int | None = None) -> callable:
    """The call's three grouped products alone (inputs prepared once, as the call prepares them),
    the input split as the layer splits it or into `splits`."""
    plan = moe.plan(experts)
    xs = x.half()[plan.row_of_slot]
    act = torch.randn(len(xs), moe.down.in_features, device=x.device).half()

    def run():
        for p, rows in ((moe.gate, xs), (moe.up, xs), (moe.down, act)):
            config = plan.config(p.in_features, p.out_features)
            exl3_triton.expert_products(rows, plan.items, p.table, plan.counts, plan.starts, p.in_features,
                                        p.out_features, **{**config, "splits": splits or config["splits"]})
    return run


def compiled_kernels() -> list[dict]:
    """Registers and spills of every compiled variant of our product kernel (Triton's cache; a
    Triton whose cache is laid out otherwise gives the error instead)."""
    out = []
    try:
        for entry in exl3_triton._expert_tiles_kernel.device_caches.values():
            for key, kernel in entry[0].items():
                kernel._init_handles()
                out.append({"variant": str(key)[-160:], "registers": kernel.n_regs, "spills": kernel.n_spills})
    except Exception as exc:  # noqa: BLE001 - a figure left out, not the run
        out.append({"error": f"{type(exc).__name__}: {exc}"})
    return out


def profile(fn) -> str:
    """The kernels of 5 eager calls of fn by device time (torch's profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)


def compare(befores: list[str], afters: list[str], out: str) -> dict:
    """Runs of this script by the code before a change and after it, alternated in one call
    (gpu.sh ONLY_DRAFTER_ROUND=moe-before-after): per row count the mean over each side's runs
    of the layer's time and of its products', after over before, the products' trellis rate,
    and each side's spread across its runs (the largest time over the smallest)."""
    sides = []
    for paths in (befores, afters):
        runs = []
        for path in paths:
            with open(path) as f:
                runs.append(json.load(f))
        sides.append(runs)
    codes = [{r.get("remote_drafter") for r in runs} - {None} for runs in sides]  # runs before it recorded none
    if codes[0] & codes[1]:
        raise SystemExit(f"before and after ran the same code ({sorted(codes[0] & codes[1])}): nothing to compare")
    res = {"before": befores, "after": afters, "device": sides[1][0]["device"], "rows": []}
    for at, row in enumerate(sides[1][0]["rows"]):
        entry = {"rows": row["rows"]}
        for key, name in (("ours_ms", "layer_ms"), ("ours_products_ms", "products_ms")):
            times = [[run["rows"][at][key] for run in runs] for runs in sides]
            means = [sum(t) / len(t) for t in times]
            entry[name] = [round(m, 4) for m in means]
            entry[f"{name}_after_over_before"] = round(means[1] / means[0], 3)
            entry[f"{name}_spread"] = [round(max(t) / min(t), 3) for t in times]
        entry["products_tb_s"] = [round(row["trellis_bytes"] / m / 1e9, 2) for m in entry["products_ms"]]
        entry["configs_after"] = [run["rows"][at]["ours_config"] for run in sides[1]]
        res["rows"].append(entry)
        print(f"{row['rows']} rows: layer {entry['layer_ms'][0]:.3f} -> {entry['layer_ms'][1]:.3f} ms "
              f"({entry['layer_ms_after_over_before']}x), products {entry['products_ms'][0]:.3f} -> "
              f"{entry['products_ms'][1]:.3f} ms ({entry['products_tb_s'][0]} -> {entry['products_tb_s'][1]} TB/s)")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="5,20,80", help="row counts (default %(default)s)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="instead: runs of this script "
                        "by the code before a change and after it, each side's JSONs comma-separated, set side "
                        "by side (--out)")
    parser.add_argument("--replays", type=int, default=50, help="graph replays a figure (default %(default)s)")
    parser.add_argument("--out", default="exl3-moe-layer.json", help="JSON results (default %(default)s)")
    parser.add_argument("--profile", metavar="FILE", help="also write our layer's kernels by device time (torch "
                        "profiler, 5 eager calls a row count, the best configuration) to FILE")
    args = parser.parse_args(argv)
    if args.compare:
        compare(*(side.split(",") for side in args.compare), args.out)
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    hidden, inter = FLASH["hidden_size"], FLASH["moe_intermediate_size"]
    experts, top_k = FLASH["dspark_n_routed_experts"], FLASH["dspark_num_experts_per_tok"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    routed = [(random_stored(hidden, inter, gen), random_stored(hidden, inter, gen), random_stored(inter, hidden, gen))
              for _ in range(experts)]
    shared = (random_stored(hidden, inter, gen), random_stored(hidden, inter, gen), random_stored(inter, hidden, gen))
    ours = TritonExl3Experts(routed, shared, LIMIT)
    theirs, why = None, None
    if (why := exl3.refusal("cuda:0")) is None:
        try:
            theirs = exllamav3_layer(routed, shared, top_k)
        except Exception as exc:  # noqa: BLE001 - recorded; ours is still measured
            why = f"{type(exc).__name__}: {exc}"
    expert_bytes = sum(s.trellis.numel() * 2 for s in shared)
    cpu_gen = torch.Generator().manual_seed(1)
    results, profiles = [], []
    for rows in (int(r) for r in args.rows.split(",")):
        chosen = CHOSEN.get(rows, min(experts, max(top_k, 2 * rows)))
        weights, picks = routing(rows, chosen, experts, top_k, cpu_gen)
        x = torch.randn(rows, hidden, device="cuda", generator=gen).half()
        call = (x, weights, picks)
        started = time.monotonic()
        tuned = ours.tune([call])[rows]  # as a worker tunes it at start-up
        tune_s = time.monotonic() - started
        trials = [{**config, "ms": ms} for config, ms in zip(ours.CONFIGS, tuned["trials"])]
        ms = in_graph(lambda a=call: ours(*a), args.replays, calls=1) / 1e3
        read = (chosen + 1) * expert_bytes
        row = {"rows": rows, "experts_chosen": chosen, "trellis_bytes": read, "ours_ms": ms,
               "ours_config": tuned["config"], "tune_s": round(tune_s, 2),
               "ours_gb_s": read / ms / 1e6,
               "ours_products_ms": in_graph(products_only(ours, *call), args.replays, calls=1) / 1e3,
               "products_ms_by_splits": {n: in_graph(products_only(ours, *call, n), args.replays, calls=1) / 1e3
                                          for n in SPLITS},
               "trials": trials, "plan_ms": tuned.get("plan_ms"), "plan_refusal": ours.plan_refusal}
        if ours.plan_refusal is None:  # the whole layer with each plan, the kernel's and torch's sort
            chosen_plans, row["ours_ms_by_plan"] = ours.plan_kernel_at, {}
            try:
                for name, kernel in (("kernel", True), ("torch", False)):
                    ours.plan_kernel_at = {rows: kernel}
                    try:
                        row["ours_ms_by_plan"][name] = in_graph(lambda a=call: ours(*a), args.replays, calls=1) / 1e3
                    except Exception as exc:  # noqa: BLE001 - recorded; the other plan and the rest go on
                        row["ours_ms_by_plan"][name] = f"{type(exc).__name__}: {exc}"
            finally:
                ours.plan_kernel_at = chosen_plans
        if theirs is not None:
            mine = ours(x, weights, picks)
            theirs_out = theirs(x, weights, picks).clone()
            row["exllamav3_ms"] = in_graph(lambda a=call: theirs(*a), args.replays, calls=1) / 1e3
            row["exllamav3_over_ours"] = row["exllamav3_ms"] / row["ours_ms"]
            row["relative_difference"] = float((mine - theirs_out).norm() / theirs_out.norm())
        results.append(row)
        if args.profile:
            profiles.append(f"== {rows} rows\n" + profile(lambda a=call: ours(*a)))
        print(json.dumps({k: v for k, v in row.items() if k != "trials"}), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "remote_drafter": str(Path(exl3_triton.__file__).parents[1]), "hidden": hidden,
                   "intermediate": inter, "experts": experts, "top_k": top_k, "bits": exl3_triton.BITS,
                   "exllamav3": "compared" if theirs is not None else f"not compared ({why})",
                   "rows": results, "compiled": compiled_kernels()}, f, indent=1)
    if args.profile:
        Path(args.profile).write_text("\n".join(profiles))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
