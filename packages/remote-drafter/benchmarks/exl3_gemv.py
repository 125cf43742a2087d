"""An EXL3 linear at a few rows with a kernel of our own (Triton) against exllamav3's: the first
step towards expert kernels near the format's decode ceiling on an H200 (exl3_decode_rate.py).
The kernel (models/exl3_triton.py's, with one expert) reads exllamav3's stored 4-bit trellis
as it is (models/exl3_format.py says how), decodes each weight (mul1) and multiplies it with
16 rows at a time on the tensor cores, accumulating in fp32; each program takes NT 16-wide
tile columns over a slice of the input (split K, partials summed by torch, so the result does
not depend on timing). The Hadamard rotations on both sides are torch's, as exllamav3 applies
them around its kernel.

On a GPU (the measurement; needs exllamav3 for its side): 16 linears of 4096 x 2048 with random
trellis bytes, called in turn (64 MiB: read from memory, not from L2), rows 1 / 2 / 4 / 8 / 16:
our kernel alone (the best of splits 1 to 16 and 4 to 16 tile columns a program) and the whole
linear (with the rotations) against exllamav3's LinearEXL3 forward on the same tensors, all in
CUDA graphs, per linear, and the kernel's rate in GB/s of trellis (at this size every kernel is
latency-bound: exl3_decode_rate.py measures rates against the read rate). The outputs are
compared with exllamav3's first. Writes JSON (--out).

    source tools/gpu-env.sh .whl   # with exllamav3 1.6.5 and its missing needs
    python3 packages/remote-drafter/benchmarks/exl3_gemv.py --out exl3-gemv.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # before Triton defines a kernel: it picks interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).parent))
from remote_drafter.models import exl3_format, exl3_triton  # noqa: E402

BITS = exl3_triton.BITS


class OneExpert:
    """One EXL3 linear as our experts' kernel takes it (models/exl3_triton.py, one expert), for
    `rows` rows: its tables and work items, made once (a timed CUDA graph refuses their copies
    to the device)."""

    def __init__(self, trellis: torch.Tensor, suh, svh, rows: int):
        if trellis.shape[2] != 16 * BITS:
            raise ValueError(f"this kernel reads {BITS}-bit trellis, not {trellis.shape[2] // 16}-bit")
        dev = trellis.device
        self.trellis, self.suh, self.svh = trellis, suh, svh
        self.table = torch.tensor([trellis.data_ptr()] * 2, dtype=torch.int64, device=dev)  # + the padding expert's
        self.counts = torch.tensor([rows, 0], dtype=torch.int32, device=dev)
        self.starts = torch.zeros_like(self.counts)
        self.items = exl3_triton.work_items(self.counts, exl3_triton.max_items(rows, 1))
        self.hadamard = exl3_triton.hadamard(dev)

    def inner(self, x: torch.Tensor, splits: int = 1, nt: int = 4) -> torch.Tensor:
        """fp32 [M, out] = x [M, in] (fp16, rotated already) @ the decoded weight [in, out]."""
        in_tiles, out_tiles = self.trellis.shape[:2]
        return exl3_triton.expert_products(x.contiguous(), self.items, self.table, self.counts, self.starts,
                                           in_tiles * 16, out_tiles * 16, splits, nt=nt).sum(0)

    def linear(self, x: torch.Tensor, splits: int = 1, nt: int = 4) -> torch.Tensor:
        """fp16 [M, out] = x [M, in] @ the linear's weight: the rows rotated as exllamav3 rotates
        them (times suh, a 128-point Hadamard per block), the kernel, the output rotated back and
        scaled by svh."""
        y = self.inner(exl3_triton.rotated_in(x, self.suh, self.hadamard), splits, nt)
        return exl3_triton.rotated_out(y, self.svh, self.hadamard).half()


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference over exllamav3's largest output."""
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())


def timed(fn) -> float:
    """ms of fn() in a CUDA graph (round_phases.in_graph: the median of 50 replays)."""
    from round_phases import in_graph
    return in_graph(fn, 50, calls=1) / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-features", type=int, default=4096, help="the linears' inputs (default %(default)s)")
    parser.add_argument("--out-features", type=int, default=2048, help="their outputs (default %(default)s)")
    parser.add_argument("--rows", default="1,2,4,8,16", help="row counts timed, up to 16 (default %(default)s)")
    parser.add_argument("--linears", type=int, default=16, help="distinct linears a timed round calls in turn "
                        "(default 16: 64 MiB of trellis at the default size, more than the H200's L2)")
    parser.add_argument("--out", default="exl3-gemv.json", help="JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    from remote_drafter.models import exl3
    if (why := exl3.refusal("cuda:0")) is not None:
        parser.error(why)
    lib = exl3.load_exllamav3()
    dev = torch.device("cuda:0")
    gen = torch.Generator(device=dev).manual_seed(0)
    k, n, count = args.in_features, args.out_features, args.linears
    mul1 = torch.tensor(np.uint32(exl3_format.MUL1_MULT).view(np.int32).item(), dtype=torch.int32, device=dev)
    # several linears, so that a round of calls reads them from memory, not from L2
    every = torch.randint(-2**15, 2**15, (count, k // 16, n // 16, 16 * BITS), dtype=torch.int16, device=dev,
                          generator=gen)  # every bit pattern is a valid trellis
    linears = []
    for trellis in every:
        suh = torch.randn(k, device=dev, generator=gen).sign().half()
        svh = (torch.rand(n, device=dev, generator=gen) * 0.02).half()
        theirs = lib.LinearEXL3(None, k, n, suh=suh, svh=svh, trellis=trellis, mcg=None, mul1=mul1,
                                out_dtype=torch.half)
        linears.append((trellis, suh, svh, theirs))
    read = count * linears[0][0].numel() * 2  # bytes of trellis a round of calls reads
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k, device=dev, generator=gen).half()
        ours = [OneExpert(t, u, v, rows) for t, u, v, _ in linears]
        error = max(relative_error(mine.linear(x, 4), theirs.forward(x, {}))
                    for mine, (*_, theirs) in zip(ours[:2], linears))
        if error > 0.05:  # exllamav3's few-row path rounds otherwise than ours; a misread weight differs by far more
            raise SystemExit(f"{rows} rows: our linear differs from exllamav3's by {error:.1%} of its largest output")
        configs = {(s, nt): timed(lambda x=x, s=s, nt=nt, ours=ours: [m.inner(x, s, nt) for m in ours]) / count
                   for s in (1, 2, 4, 8, 16) for nt in (4, 8, 16) if (k // 16) % s == 0}
        splits, nt = min(configs, key=configs.get)
        row = {"rows": rows, "splits": splits, "nt": nt, "kernel_ms": configs[splits, nt],
               "max_error_vs_exllamav3": error,
               "linear_ms": timed(lambda x=x, s=splits, nt=nt, ours=ours: [m.linear(x, s, nt) for m in ours])
               / count,
               "exllamav3_ms": timed(lambda x=x: [theirs.forward(x, {}) for *_, theirs in linears]) / count}
        row["kernel_gb_s"] = read / count / (row["kernel_ms"] / 1e3) / 1e9
        row["exllamav3_over_linear"] = row["exllamav3_ms"] / row["linear_ms"]
        results.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "in": k, "out": n, "bits": BITS, "linears": count,
                   "rows": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
