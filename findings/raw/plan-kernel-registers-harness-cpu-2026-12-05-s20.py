"""Session 20's trial (any CPU, no GPU): the experts' plan kernel (_plan_kernel) compiled for
sm_90 with larger steps (B slots a step) and more warps, as remote_drafter.testing compiles
the round's kernels: registers a thread and bytes spilled to the stack, for the Flash
drafter's 192 experts and DeepSeek-V4's 256 (E = 256 or 512 with the padding expert), with
and without the shared expert. From the repository root, TRITON_INTERPRET unset:
    TRITON_CACHE_DIR=/tmp/triton-cache python findings/raw/plan-kernel-registers-harness-cpu-2026-12-05-s20.py
"""

from remote_drafter.models import exl3_triton, exl3_triton_experts
from remote_drafter.testing import compiled_for, resource_usage

INTS = dict.fromkeys(("rows", "k", "total", "bound"), "i32")
POINTERS = {"experts_ptr": "*i64", "counts_ptr": "*i32", "starts_ptr": "*i32", "row_of_slot_ptr": "*i64",
            "expert_of_slot_ptr": "*i64", "slot_of_ptr": "*i64", "item_expert_ptr": "*i64", "item_row_ptr": "*i32"}

print("B warps | shared E=256 | shared E=512 | unshared E=256 | unshared E=512")
for block, warps in ((32, 8), (32, 4), (64, 8), (64, 16), (128, 16), (128, 32), (64, 32)):
    cells = []
    for shared in (True, False):
        for experts in (256, 512):
            line = resource_usage(compiled_for(
                exl3_triton_experts._plan_kernel, {**INTS, **POINTERS},
                {"SHARED": shared, "E": experts, "B": block, "ITEM": exl3_triton.ITEM_ROWS}, 90, num_warps=warps))
            cells.append(" ".join(line.split()[:2]))
    print(block, warps, "|", " | ".join(cells), flush=True)
