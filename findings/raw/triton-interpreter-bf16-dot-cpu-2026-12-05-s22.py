"""Session 22: Triton's CPU interpreter (TRITON_INTERPRET=1; Triton 3.9, CI's) multiplies bf16
tiles wrongly: a 16 x 16 bf16 tl.dot, plain and with its second operand transposed, against
torch's float32 product of the same values. Prints the largest absolute difference. Why
kernels.attend computes its scores' products in float32 there.
    python findings/raw/triton-interpreter-bf16-dot-cpu-2026-12-05-s22.py
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton defines a kernel

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def product(a_ptr, b_ptr, o_ptr, TRANS: tl.constexpr):
    i = tl.arange(0, 16)
    a = tl.load(a_ptr + i[:, None] * 16 + i[None, :])
    b = tl.load(b_ptr + i[:, None] * 16 + i[None, :])
    if TRANS:
        o = tl.dot(a, tl.trans(b))
    else:
        o = tl.dot(a, b)
    tl.store(o_ptr + i[:, None] * 16 + i[None, :], o)


torch.manual_seed(0)
a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
for trans in (False, True):
    o = torch.empty(16, 16)
    product[(1,)](a, b, o, TRANS=trans)
    want = a.float() @ (b.float().T if trans else b.float())
    print("transposed" if trans else "plain", (o - want).abs().max().item())
