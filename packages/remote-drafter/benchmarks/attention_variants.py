"""The window's attention kernel (models/dsv41/kernels.py, `attend`) at the Flash drafter's
shapes, in every form a round may run (kernels.ATTEND_VARIANTS: its defaults, the keys split
over several programs a block of query rows and joined by a second launch, the weighted
sum's dot on the tensor cores (tf32x3)). Each variant is timed as a round runs it,
inside a CUDA graph (20 calls a graph, the median of 50 replays), and checked against torch's float32
attention on the same rows (its relative error, and the start-up check's tolerance).

    python packages/remote-drafter/benchmarks/attention_variants.py --out attention-variants.json

(`gpu.sh` with `ONLY_DRAFTER_ROUND=attention`; no exllamav3.) The table says which variant
is fastest at each batch: what a drafter's start-up choice (Dsv41Model.choose_attention,
REMOTE_DRAFTER_ATTENTION=auto) should find on the same card."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from remote_drafter.models.dsv41 import kernels
from remote_drafter.models.dsv41.modules.attention import unseen_keys
from remote_drafter.models.dsv41.modules.numerics import attention, relative_error

sys.path.insert(0, str(Path(__file__).parent))
from round_phases import in_graph  # noqa: E402

HEADS, HEAD_DIM, BLOCK, WINDOW, LAYERS = 64, 512, 5, 128, 3  # the estimated Flash drafter's (dsv41_gpu.FLASH)
REPLAYS = 50
TOLERANCE = 2 ** -7  # two bf16 steps: what Dsv41Model's start-up check allows a bf16 model's kernels


def rows(batch: int, seed: int) -> tuple:
    """A layer's attention inputs as a round has them: q [B, W, H, D] bf16, one layer's rows of
    the windows (strided) with every context row valid, the block's new rows, the sinks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, BLOCK, HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    windows = torch.randn(batch, WINDOW, LAYERS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    new = torch.randn(batch, BLOCK, HEAD_DIM, generator=g, device="cuda").bfloat16()
    unseen = unseen_keys(torch.ones(batch, WINDOW, dtype=torch.bool, device="cuda"), BLOCK)
    sink = torch.randn(HEADS, generator=g, device="cuda")
    return q, windows[:, :, 1], new, unseen, sink


def measure(batches: list[int]) -> dict:
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {
        "heads": HEADS, "head_dim": HEAD_DIM, "block": BLOCK, "window": WINDOW}, "tolerance": TOLERANCE, "batches": []}
    for batch in batches:
        args = rows(batch, batch)
        want = attention(*args, torch.float32)
        entry = {"batch": batch, "torch_us": in_graph(lambda a=args: attention(*a, torch.float32), REPLAYS),
                 "variants": {}}
        for name, options in kernels.ATTEND_VARIANTS.items():
            try:
                got = kernels.attend(*args, **options)
                entry["variants"][name] = {"us": in_graph(lambda a=args, o=options: kernels.attend(*a, **o), REPLAYS),
                                           "relative_error": relative_error(want, got)}
            except Exception as exc:  # noqa: BLE001 - a variant that does not build or run is reported, the rest go on
                entry["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        res["batches"].append(entry)
    return res


def table(res: dict) -> str:
    lines = [f"{res['device']}: one layer's attention, µs a call in a CUDA graph (relative error to torch's float32;"
             f" ! = past the start-up check's {res['tolerance']:.1e})",
             f"{'variant':<22}" + "".join(f"{'batch ' + str(b['batch']):>22}" for b in res["batches"])]
    names = list(res["batches"][0]["variants"])
    for name in ["torch"] + names:
        cells = []
        for b in res["batches"]:
            if name == "torch":
                cells.append(f"{b['torch_us']:>22.1f}")
                continue
            v = b["variants"][name]
            flag = "!" if v.get("relative_error", 1.0) > res["tolerance"] else " "
            cells.append(f"{'error':>22}" if "error" in v else f"{v['us']:>10.1f} ({v['relative_error']:.1e}){flag}")
        lines.append(f"{name:<22}" + "".join(cells))
    for b in res["batches"]:
        ok = {n: v for n, v in b["variants"].items() if "us" in v and v["relative_error"] <= res["tolerance"]}
        if ok:
            best = min(ok, key=lambda n: ok[n]["us"])
            lines.append(f"batch {b['batch']}: fastest {best} ({ok[best]['us']:.1f} µs, "
                         f"{ok[best]['us'] / b['variants']['default']['us']:.2f}x the default)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16", help="requests a round (default: %(default)s)")
    ap.add_argument("--out", default="attention-variants.json", help="JSON results (default: %(default)s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    res = measure([int(b) for b in args.batches.split(",")])
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
