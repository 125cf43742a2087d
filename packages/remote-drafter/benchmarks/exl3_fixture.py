"""exllamav3's EXL3 linears as test data, made on a CUDA GPU with exllamav3 (the `[exl3]` extra):
small random linears quantised by exllamav3's own quantiser as our packs are
(`models/exl3.quantise`: mul1 codebook, uncalibrated), written with what exllamav3 itself makes
of them, so that code of ours which reads the stored trellis (models/exl3_format.py, a kernel)
is checked against exllamav3 bit for bit on any machine, without a GPU or exllamav3
(tests/test_exl3_format.py).

Per linear (`<bits>bit.` prefix; in 256, out 128: not square, so a transposition shows):
  trellis, suh, svh, mul1   the stored tensors, as a pack holds them
  states                    int16 [in/16, out/16, 256]: each weight's 16-bit trellis state,
                            in the tile's stored order (exllamav3's unpack_trellis)
  decoded                   fp16 [in, out]: the weights the codebook gives, before the
                            Hadamard rotations and scales (exllamav3's reconstruct)
  weight                    fp16 [in, out]: the weight the linear applies (LinearEXL3's
                            get_weight_tensor: rotations and scales applied)
  x, y                      fp16 rows in [5, in] and LinearEXL3's output [5, out]

    source tools/gpu-env.sh .whl   # .whl: exllamav3 1.6.5 and what the GPU machine lacks of its needs
    TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 packages/remote-drafter/benchmarks/exl3_fixture.py \
        --out packages/remote-drafter/tests/data/exl3-linears.safetensors
"""

from __future__ import annotations

import argparse
import sys

import torch

from remote_drafter.models import exl3

IN, OUT, ROWS = 256, 128, 5


def linear_fixture(bits: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    lib = exl3.load_exllamav3()
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT, IN, generator=gen) / IN ** 0.5  # torch's layout [out, in]
    stored = exl3.quantise(weight, bits, seed, device)
    if "mul1" not in stored:
        raise RuntimeError(f"exllamav3 stored {sorted(stored)}: expected the mul1 codebook")
    t = {k: v.to(device) for k, v in stored.items()}
    linear = lib.LinearEXL3(None, IN, OUT, suh=t["suh"], svh=t["svh"], trellis=t["trellis"],
                            mcg=None, mul1=t["mul1"], out_dtype=torch.half)
    states = torch.empty((IN // 16, OUT // 16, 256), dtype=torch.int16, device=device)
    lib.ext.unpack_trellis(states, t["trellis"], bits)
    decoded = torch.empty((IN, OUT), dtype=torch.half, device=device)
    lib.ext.reconstruct(decoded, t["trellis"], float(bits), False, True)  # mcg, mul1
    x = torch.randn(ROWS, IN, generator=gen).half().to(device)
    y = linear.forward(x.contiguous(), {})
    out = {**stored, "states": states, "decoded": decoded, "weight": linear.get_weight_tensor(),
           "x": x, "y": y}
    return {f"{bits}bit.{k}": v.detach().cpu().contiguous() for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the safetensors file to write")
    parser.add_argument("--bits", default="4,6", help="bits a weight of each linear (default 4,6: "
                        "the drafter's linears and an EXL3 head)")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device exllamav3 quantises on "
                        "(default %(default)s)")
    args = parser.parse_args(argv)
    if (why := exl3.refusal(args.device)) is not None:
        parser.error(why)
    from safetensors.torch import save_file
    tensors = {}
    for seed, bits in enumerate(int(b) for b in args.bits.split(",")):
        tensors.update(linear_fixture(bits, seed, args.device))
        print(f"{bits} bits: " + ", ".join(f"{k.split('.', 1)[1]} {tuple(v.shape)} {v.dtype}"
                                           for k, v in tensors.items() if k.startswith(f"{bits}bit.")))
    save_file(tensors, args.out, metadata={"exllamav3": exl3.load_exllamav3().version})
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
