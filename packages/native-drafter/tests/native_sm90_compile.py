"""Compile every kernel variant the round launches for sm_90 (Triton's front end and ptxas,
no GPU needed): the interpreter skips the compiler's checks (a loop variable that changes
shape passed every interpreted test and failed on the H200). Run by test_native_sm90_compile
in a process without TRITON_INTERPRET; prints one line per variant."""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from native_drafter import kernels as K

TARGET = GPUTarget("cuda", 90, 32)
F = "*fp32"


def build(fn, signature, constants, **options):
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants), target=TARGET, options=options)
    print(fn.__name__, constants, "ok")


def main():
    linear = {"x_ptr": F, "w_ptr": F, "w2_ptr": F, "g_ptr": F, "r_ptr": F, "y_ptr": F, "M": "i32", "N": "i32",
              "K": "i32", "eps": "fp32", "PRECISION": "constexpr", "NORM": "constexpr", "RESID": "constexpr",
              "SWIGLU": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    for norm, resid, swiglu, bm in ((False, False, False, 128), (True, False, False, 128), (True, False, False, 16),
                                    (False, True, False, 16), (True, False, True, 64), (True, False, True, 16)):
        build(K._linear_kernel, linear, {"PRECISION": K.LINEAR_PRECISION, "NORM": norm, "RESID": resid,
                                         "SWIGLU": swiglu, "BM": bm, "BN": 64, "BK": 64},
              num_warps=8 if bm >= 64 else 4, num_stages=2)
    attention = {"qkv_ptr": F, "kv_ptr": F, "cos_c_ptr": F, "sin_c_ptr": F, "cos_b_ptr": F, "sin_b_ptr": F,
                 "valid_ptr": "*u8", "o_ptr": F, "p_ptr": F, "C": "i32", "W": "i32", "scale": "fp32",
                 "H": "constexpr", "KVH": "constexpr", "D": "constexpr", "WP": "constexpr", "BC": "constexpr",
                 "PROBS": "constexpr"}
    for probs in (False, True):
        build(K._attention_kernel, attention, {"H": 9, "KVH": 3, "D": 64, "WP": 16, "BC": 64, "PROBS": probs},
              num_warps=4)
    markov = {"z_ptr": F, "prev_ptr": "*i64", "prev_stride": "i32", "w1_ptr": F, "w2_ptr": F, "out_ptr": F,
              "best_v_ptr": F, "best_i_ptr": "*i32", "V": "i32", "z_stride": "i32", "out_stride": "i32", "R": "i32",
              "RP": "constexpr", "BV": "constexpr"}
    build(K._markov_kernel, markov, {"RP": 32, "BV": K.MARKOV_BV}, num_warps=4)
    argmax = {"best_v_ptr": F, "best_i_ptr": "*i32", "tok_ptr": "*i64", "tok_stride": "i32", "NT": "i32", "V": "i32",
              "NTP": "constexpr"}
    build(K._argmax_kernel, argmax, {"NTP": 256}, num_warps=4)


if __name__ == "__main__":
    main()
