"""Session 21's look inside the experts' product kernel on any CPU (no GPU): it is compiled for
sm_90 as tests/hopper_kernels.py compiles the round's kernels, and the main loop (the one
backward branch of the SASS) is counted by opcode: what a step of the product issues. From the
repository root, TRITON_INTERPRET unset, with the tile columns a program and warps:
    TRITON_CACHE_DIR=/tmp/triton-cache python findings/raw/expert-product-sass-harness-cpu-2026-12-05-s21.py 16 4
Apply a trial's patch first (git apply findings/raw/<patch>) to count its loop instead.
"""

import collections
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, "packages/remote-drafter/tests")
import hopper_kernels  # noqa: E402

from remote_drafter.models import exl3_triton  # noqa: E402

SIGNATURE = {"x_ptr": "*fp16", "experts_ptr": "*i64", "first_rows_ptr": "*i32", "table_ptr": "*i64",
             "counts_ptr": "*i32", "starts_ptr": "*i32", "out_ptr": "*fp32", "slots": "i32", "in_tiles": "i32",
             "out_tiles": "i32", "tiles_per_split": "i32"}


def main(nt: int, warps: int) -> None:
    constexprs = {"M": exl3_triton.ITEM_ROWS, "NT": nt, "DECODE": exl3_triton.ASM_VABSDIFF}
    source = ASTSource(fn=exl3_triton._expert_tiles_kernel,
                       signature={**SIGNATURE, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([hopper_kernels.CUOBJDUMP, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    print(hopper_kernels.usage(exl3_triton._expert_tiles_kernel, SIGNATURE, constexprs, warps))
    ops, loop = [], None
    for line in sass.splitlines():
        if m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(\s+0x([0-9a-f]+))?", line):
            at, op = int(m.group(1), 16), m.group(3)
            ops.append((at, op))
            if op == "BRA" and m.group(5) and int(m.group(5), 16) < at:
                loop = (int(m.group(5), 16), at)
    step = [op.split(".")[0] for at, op in ops if loop[0] <= at <= loop[1]]
    weights = nt * 256 // (32 * warps)
    print(f"{nt} tile columns, {warps} warps: {len(step)} SASS instructions a step, {weights} weights a thread")
    print(collections.Counter(step).most_common())


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
