"""The round's Triton kernels compiled for the drafter's GPUs on any CPU, in a process of its
own (tests/test_kernels_compile_for_the_gpus.py runs it): Hopper (sm_90, the H100 and H200 of
the GPU tier) and Ampere (sm_86, the RTX 3090 the deployment drafts on). Triton decides
between its CPU interpreter and its compiler when a kernel is defined, and the CPU tests define
them interpreted. Prints {kernel variant: {"usage": cuobjdump's resource usage line, or the
error; "shared": the shared memory a program takes, bytes}}.

    TRITON_CACHE_DIR=<a folder> python packages/remote-drafter/tests/gpu_kernels.py --arch 86
"""

import argparse
import json
import os
import sys

import triton

from remote_drafter.models import exl3_triton, exl3_triton_experts
from remote_drafter.models.dsv41 import kernels
from remote_drafter.testing import compiled_for, resource_usage

ARCHS = {90: "Hopper (H100, H200)", 86: "Ampere (RTX 3090)"}
EXPERTS, TOP_K, VOCAB = 192, 8, 129280  # the Flash drafter's routed experts, choices, vocabulary


def variants():
    """(name, fn, signature, constexprs, warps) of every kernel variant a Flash round launches."""
    ints = dict.fromkeys(("rows", "k", "total", "bound"), "i32")
    ptrs = {"experts_ptr": "*i64", "counts_ptr": "*i32", "starts_ptr": "*i32", "row_of_slot_ptr": "*i64",
            "expert_of_slot_ptr": "*i64", "slot_of_ptr": "*i64", "item_expert_ptr": "*i64", "item_row_ptr": "*i32"}
    for shared in (True, False):
        for experts in (EXPERTS, 256):  # the Flash drafter's; DeepSeek-V4's 256 (and the shared one)
            yield (f"plan shared={shared} experts={experts}", exl3_triton_experts._plan_kernel, {**ints, **ptrs},
                   {"SHARED": shared, "E": triton.next_power_of_2(experts + 2), "B": exl3_triton_experts.PLAN_BLOCK,
                    "ITEM": exl3_triton.ITEM_ROWS}, exl3_triton_experts.PLAN_WARPS)
    for name, score in kernels.SCORES.items():
        for steered in (True, False):  # with a gate bias and renormalised, and with neither
            yield (f"route {name} bias={steered}", kernels._route_kernel,
                   {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "experts_ptr": "*i64",
                    "E": "i32", "scale": "fp32"},
                   {"K": TOP_K, "KP": TOP_K, "EP": 256, "SCORE": score, "BIAS": steered, "NORM": steered}, 4)
    yield ("experts combine", exl3_triton_experts._combine_kernel,
           {"y_ptr": "*fp32", "splits": "i32", "slots": "i32", "features": "i32", "slot_of_ptr": "*i64",
            "expert_of_slot_ptr": "*i64", "weights_ptr": "*fp32", "svh_ptr": "*fp16", "signs_ptr": "*fp16",
            "out_ptr": "*fp32", "k": "i32"}, {"K": 16, "SHARED": True}, 4)
    parts = triton.cdiv(VOCAB, kernels.TOP_TWO_BLOCK)
    yield ("top two part, biased", kernels._top_two_part_kernel,
           {"x_ptr": "*fp32", "b_ptr": "*bf16", "part_ptr": "*fp32", "V": "i32", "XS": "i64", "BS": "i64"},
           {"PARTS": parts, "BLOCK": kernels.TOP_TWO_BLOCK, "BIAS": True}, 4)
    yield ("top two join", kernels._top_two_join_kernel, {"part_ptr": "*fp32", "p_ptr": "*fp32", "i_ptr": "*i64"},
           {"PARTS": parts, "PP": triton.next_power_of_2(parts)}, 4)
    k, h, mix = 4, 4096, 24  # K copies of H, (2 + K) K mix weights
    slice_ = min(kernels.MIX_SLICE, k * h)
    slices = triton.cdiv(k * h, slice_)
    yield ("mix products", kernels._hc_mix_part_kernel, {"res_ptr": "*bf16", "fn_ptr": "*fp32", "part_ptr": "*fp32"},
           {"KH": k * h, "MIX": mix, "MIXP": 32, "SLICE": slice_, "SLICES": slices,
            "BLOCK": min(kernels.MIX_BLOCK, slice_)}, 4)
    f32 = dict.fromkeys(("part_ptr", "scale_ptr", "base_ptr", "carried_ptr", "post_ptr", "comb_ptr", "pre_ptr"), "*fp32")
    for collapse in (kernels.COLLAPSE_CARRIED, kernels.COLLAPSE_OWN, kernels.COLLAPSE_FIRST):
        yield (f"mix pre collapse={collapse}", kernels._hc_pre_kernel,
               {**f32, "res_ptr": "*bf16", "norm_ptr": "*bf16", "x_ptr": "*bf16", "eps": "fp32", "hc_eps": "fp32",
                "alpha": "fp32"},
               {"H": h, "K": k, "KP": k, "MIX": mix, "SLICES": slices, "SP": triton.next_power_of_2(slices),
                "ITERS": 20, "COLLAPSE": collapse, "BLOCK": 1024}, 4)
    yield ("mix post", kernels._hc_post_kernel, {"res_ptr": "*bf16", "out_ptr": "*bf16", "post_ptr": "*fp32",
                                                 "comb_ptr": "*fp32", "new_ptr": "*bf16"},
           {"H": h, "K": k, "KP": k, "BLOCK": 256}, 4)
    yield ("rope", kernels._rope_kernel, {"x_ptr": "*bf16", "pos_ptr": "*i64", "inv_ptr": "*fp32", "out_ptr": "*bf16"},
           {"D": 512, "DIMS": 64, "G": 64, "SIGN": -1, "KEEP": 512}, 4)
    yield ("rms norm", kernels._rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
           {"D": 4096, "BLOCK": 4096, "WEIGHT": True}, 4)
    attend = {"q_ptr": "*bf16", "ctx_ptr": "*bf16", "new_ptr": "*bf16", "unseen_ptr": "*u8", "sink_ptr": "*fp32",
              "C": "i32", "W": "i32", "CS_B": "i32", "CS_C": "i32", "scale": "fp32", "SPLIT_KEYS": "i32"}
    shape = {"H": 64, "D": 512, "DP": 512, "BM": kernels.ATTEND_ROWS}
    # every form a round may run (kernels.ATTEND_VARIANTS; the splits' count is no constexpr: one build for all)
    builds = {(form.get("splits", 1) > 1, form.get("weighted_sum", "ieee")) for form in kernels.ATTEND_VARIANTS.values()}
    for split, weighted_sum in sorted(builds):
        name = " ".join(["attend"] + ["split"] * split + [weighted_sum] * (weighted_sum != "ieee"))
        out = "*fp32" if split else "*bf16"  # a split's partial softmax, or the rows themselves
        yield (name, kernels._attend_kernel, {**attend, "out_ptr": out, "m_ptr": out, "l_ptr": out},
               {**shape, "BK": kernels.ATTEND_KEYS, "SPLIT": split, "IEEE": False, "SUM": weighted_sum},
               kernels.ATTEND_WARPS)
    yield ("attend join", kernels._attend_join_kernel,
           {"part_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
            "W": "i32", "SPLITS": "i32"}, shape, kernels.ATTEND_WARPS)
    for nt, warps in sorted({(c["nt"], c["num_warps"]) for c in exl3_triton_experts.TritonExl3Experts.CONFIGS}):
        yield (f"expert products nt={nt} warps={warps}", exl3_triton._expert_tiles_kernel,
               {"x_ptr": "*fp16", "experts_ptr": "*i64", "first_rows_ptr": "*i32", "table_ptr": "*i64",
                "counts_ptr": "*i32", "starts_ptr": "*i32", "out_ptr": "*fp32", "slots": "i32", "in_tiles": "i32",
                "out_tiles": "i32", "tiles_per_split": "i32"},
               {"M": exl3_triton.ITEM_ROWS, "NT": nt, "DECODE": exl3_triton.ASM_VABSDIFF}, warps)
    common = {"expert_of_slot_ptr": "*i64", "signs_ptr": "*fp16", "out_ptr": "*fp16", "slots": "i32", "features": "i32"}
    yield ("experts rows in", exl3_triton_experts._rows_in_kernel,
           {**common, "x_ptr": "*bf16", "row_of_slot_ptr": "*i64", "suh_ptr": "*fp16"},
           {"S": exl3_triton_experts.SLOT_BLOCK}, 4)
    yield ("experts activation", exl3_triton_experts._activation_kernel,
           {**common, "g_ptr": "*fp32", "u_ptr": "*fp32", "splits": "i32", "svh_g_ptr": "*fp16", "svh_u_ptr": "*fp16",
            "suh_d_ptr": "*fp16", "limit": "fp32"},
           {"S": exl3_triton_experts.SLOT_BLOCK, "LIMITED": True}, exl3_triton_experts.ACTIVATION_WARPS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=sorted(ARCHS), default=90,
                        help="the GPU's compute capability, major and minor: " +
                        ", ".join(f"{a} {name}" for a, name in ARCHS.items()))
    arch = parser.parse_args().arch
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles the kernels")
    out = {}
    for name, fn, sig, constexprs, warps in variants():
        try:
            kernel = compiled_for(fn, sig, constexprs, arch, num_warps=warps)
            out[name] = {"usage": resource_usage(kernel), "shared": kernel.metadata.shared}
        except Exception as exc:  # noqa: BLE001 - reported per kernel, the test names it
            out[name] = {"usage": f"error: {type(exc).__name__}: {exc}", "shared": None}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
