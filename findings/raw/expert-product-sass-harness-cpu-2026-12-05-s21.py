"""Session 21's look inside the experts' product kernel on any CPU (no GPU): it is compiled for
sm_90 as tests/gpu_kernels.py compiles the round's kernels, and the main loop (the one
backward branch of the SASS) is counted by opcode: what a step of the product issues. From the
repository root, TRITON_INTERPRET unset, with the tile columns a program and warps:
    TRITON_CACHE_DIR=/tmp/triton-cache python findings/raw/expert-product-sass-harness-cpu-2026-12-05-s21.py 16 4
A third argument compiles for another GPU (86: an RTX 3090's sm_86; session 23).
Apply a trial's patch first (git apply findings/raw/<patch>) to count its loop instead.
"""

import collections
import re
import sys

sys.path.insert(0, "packages/remote-drafter/tests")
import gpu_kernels  # noqa: E402

from remote_drafter.testing import compiled_for, cubin_dump, resource_usage  # noqa: E402


def main(nt: int, warps: int, arch: int = 90) -> None:
    """The product's variant as gpu_kernels lists it (the tuning's configurations)."""
    name = f"expert products nt={nt} warps={warps}"
    found = [v for v in gpu_kernels.variants() if v[0] == name]
    if not found:
        raise SystemExit(f"no variant {name!r}: the start-up tuning does not take it")
    _, kernel, signature, constexprs, warps = found[0]
    compiled = compiled_for(kernel, signature, constexprs, arch, num_warps=warps)
    sass = cubin_dump(compiled, "-sass")
    print(resource_usage(compiled))
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
    main(*map(int, sys.argv[1:4]))
