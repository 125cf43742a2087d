"""Compile every kernel variant the round launches for a GPU (Triton's front end and ptxas, no
GPU needed), with the tiles that card's shared memory takes (kernels.tiles_for): the
interpreter skips the compiler's checks (a loop variable that changes shape passed every
interpreted test and failed on the H200), and knows no shared-memory limit (the attention
passed every test and an RTX 3090 could not have launched it). Run by test_native_gpu_compile
in a process without TRITON_INTERPRET; prints {variant: {"usage": cuobjdump's resource line,
"shared": bytes a program takes}} as JSON.

    python packages/native-drafter/tests/native_gpu_compile.py --arch 86
"""

import argparse
import json

from native_drafter import kernels as K
from remote_drafter.testing import compiled_for, resource_usage

# each card's compute capability and the tiles its shared memory takes
ARCHS = {90: ("Hopper (H100, H200)", K.ROOMY), 86: ("Ampere (RTX 3090)", K.COMPACT)}
F = "*fp32"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK, WINDOW = 576, 9, 3, 64, 16, 128  # the miniature's drafter


def variants(tiles: K.Tiles):
    """(name, kernel, signature, constexprs, launch options) of every variant a round launches."""
    linear = {"x_ptr": F, "w_ptr": F, "w2_ptr": F, "g_ptr": F, "r_ptr": F, "y_ptr": F, "M": "i32", "N": "i32",
              "K": "i32", "eps": "fp32"}
    # (norm, residual, SwiGLU, rows): the context's and the block's projections at their sizes
    for norm, resid, swiglu, rows in ((False, False, False, 2048), (True, False, False, 2048), (True, False, False, 16),
                                      (False, True, False, 16), (True, False, True, 2048), (True, False, True, 16)):
        launch = K.linear_launch(rows, HIDDEN, swiglu, tiles)
        options = {k: launch.pop(k) for k in ("num_warps", "num_stages")}
        yield (f"linear norm={norm} resid={resid} swiglu={swiglu} rows={rows}", K._linear_kernel, linear,
               {"PRECISION": K.LINEAR_PRECISION, "NORM": norm, "RESID": resid, "SWIGLU": swiglu, **launch}, options)
    attention = {"qkv_ptr": F, "kv_ptr": F, "cos_c_ptr": F, "sin_c_ptr": F, "cos_b_ptr": F, "sin_b_ptr": F,
                 "valid_ptr": "*u8", "o_ptr": F, "p_ptr": F, "C": "i32", "W": "i32", "scale": "fp32"}
    for probs in (False, True):
        launch = K.attention_launch(BLOCK, WINDOW, tiles)
        options = {"num_warps": launch.pop("num_warps")}
        yield (f"attention probs={probs}", K._attention_kernel, attention,
               {"H": HEADS, "KVH": KV_HEADS, "D": HEAD_DIM, "PROBS": probs, **launch}, options)
    markov = {"z_ptr": F, "prev_ptr": "*i64", "prev_stride": "i32", "w1_ptr": F, "w2_ptr": F, "out_ptr": F,
              "best_v_ptr": F, "best_i_ptr": "*i32", "V": "i32", "z_stride": "i32", "out_stride": "i32", "R": "i32"}
    yield "markov", K._markov_kernel, markov, {"RP": 32, "BV": K.MARKOV_BV}, {"num_warps": 4}
    argmax = {"best_v_ptr": F, "best_i_ptr": "*i32", "tok_ptr": "*i64", "tok_stride": "i32", "NT": "i32", "V": "i32"}
    yield "argmax", K._argmax_kernel, argmax, {"NTP": 256}, {"num_warps": 4}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, choices=sorted(ARCHS), default=90,
                        help="the GPU's compute capability: " + ", ".join(f"{a} {n}" for a, (n, _) in ARCHS.items()))
    arch = parser.parse_args().arch
    out = {}
    for name, fn, signature, constexprs, options in variants(ARCHS[arch][1]):
        try:
            kernel = compiled_for(fn, signature, constexprs, arch, **options)
            out[name] = {"usage": resource_usage(kernel), "shared": kernel.metadata.shared}
        except Exception as exc:  # noqa: BLE001 - reported per variant, the test names it
            out[name] = {"usage": f"error: {type(exc).__name__}: {exc}", "shared": None}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
