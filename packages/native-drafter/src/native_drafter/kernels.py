"""Triton kernels of the drafter round (launchers below each kernel).

Why Triton: the round is a handful of small, memory-bound matrix products, one attention
over 128 + W keys and a vocabulary-wide reduction; Triton expresses each as one kernel
with fused prologues/epilogues, runs on the H200 (triton 3.6) and, for the CI tests, in its
CPU interpreter (TRITON_INTERPRET=1), so the same source is checked on both.

Arithmetic: float32 weights and activations, as the worker's default torch back end
computes; projections multiply by 3xTF32 (float32-grade, ~1e-6; never plain TF32), the
attention's small products in IEEE float32;
every logit that decides a draft token (head, Markov correction, argmax) is float32. Nothing here reads a value back to the host, so a round is one
CUDA-graph capture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(n)))


@dataclass(frozen=True)
class Tiles:
    """The tile sizes and warps that decide a program's shared memory and registers."""
    name: str  # what the worker's status says
    rows: int  # a projection's rows a program (SwiGLU's: at most 64)
    cols: int  # its output columns a program
    depth: int  # the inputs it sums a step
    keys: int  # the attention's context keys a step
    attention_warps: int


# An H100 or H200 gives a program 227 KiB of shared memory, an A100 163; an RTX 3090 99, where
# ROOMY's normed projection and attention do not launch. ROOMY is the set the H200 runs were
# timed with; COMPACT fits a 3090 and keeps every variant in registers there
# (tests/native_gpu_compile.py measures both on both cards). COMPACT sums over shorter steps
# (32 inputs, 32 keys): float32 rounding differs in the last bits, within the gate's tolerances.
ROOMY = Tiles("roomy", rows=128, cols=64, depth=64, keys=64, attention_warps=4)
COMPACT = Tiles("compact", rows=64, cols=32, depth=32, keys=32, attention_warps=8)
ROOMY_SHARED = 160 << 10  # the shared memory a program of ROOMY's tiles may take, bytes


def _max_shared(index: int) -> int:
    """The shared memory CUDA device `index` gives one program (opted in), bytes: the limit
    Triton's launcher holds a kernel to."""
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


@functools.cache
def _tiles_on(index: int) -> Tiles:
    return ROOMY if _max_shared(index) >= ROOMY_SHARED else COMPACT


def tiles_for(device: torch.device | str) -> Tiles:
    """The tiles a card's shared memory fits (ROOMY off a GPU: Triton's CPU interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return ROOMY
    return _tiles_on(torch.cuda.current_device() if device.index is None else device.index)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, w2_ptr, g_ptr, r_ptr, y_ptr, M, N, K, eps, PRECISION: tl.constexpr,
                   NORM: tl.constexpr, RESID: tl.constexpr, SWIGLU: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[M, N] = f(x)[M, K] @ w[N, K]^T (+ r), where f is RMSNorm(x) * g when NORM, and the
    product is silu(x w^T) * (x w2^T) when SWIGLU (the norm folded into the operand load:
    the normed rows never touch memory)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mm, nm = rm < M, rn < N
    if NORM:
        ss = tl.zeros([BM], tl.float32)
        for k0 in range(0, K, BK):
            km = (k0 + rk) < K
            x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            ss += tl.sum(x * x, 1)
        inv = tl.rsqrt(ss / K + eps)
    acc = tl.zeros([BM, BN], tl.float32)
    acc2 = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        km = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        if NORM:
            g = tl.load(g_ptr + k0 + rk, mask=km, other=0.0).to(tl.float32)
            x = (x * inv[:, None]) * g[None, :]
        wmask = km[:, None] & nm[None, :]
        w = tl.load(w_ptr + rn[None, :] * K + (k0 + rk)[:, None], mask=wmask, other=0.0)
        acc += tl.dot(x, w, input_precision=PRECISION)
        if SWIGLU:
            w2 = tl.load(w2_ptr + rn[None, :] * K + (k0 + rk)[:, None], mask=wmask, other=0.0)
            acc2 += tl.dot(x, w2, input_precision=PRECISION)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc2
    out = rm[:, None] * N + rn[None, :]
    om = mm[:, None] & nm[None, :]
    if RESID:
        acc += tl.load(r_ptr + out, mask=om, other=0.0)
    tl.store(y_ptr + out, acc, mask=om)


# The projections' products: 3xTF32 (each float32 operand split into two TF32 parts, three
# tensor-core products, float32 accumulation: float32-grade). "ieee" (CUDA-core FMA) is as
# correct but slower than torch's own products (findings/native-drafter.md).
LINEAR_PRECISION = "tf32x3"


def linear_launch(m: int, k: int, swiglu: bool, tiles: Tiles) -> dict:
    """The projection kernel's tiles and launch options for an [m, k] operand."""
    bm = min(64 if swiglu else tiles.rows, tiles.rows, _pow2(m))
    return {"BM": bm, "BN": tiles.cols, "BK": min(tiles.depth, _pow2(k)), "num_warps": 8 if bm >= 64 else 4,
            "num_stages": 2}


def linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, norm: torch.Tensor | None = None,
           eps: float = 0.0, resid: torch.Tensor | None = None, w2: torch.Tensor | None = None,
           tiles: Tiles | None = None) -> torch.Tensor:
    """y = [RMSNorm_norm](x) @ w^T [+ resid]; with w2: silu(. @ w^T) * (. @ w2^T). x, y, resid
    contiguous float32 [M, *]; w, w2 [N, K] float32; `tiles`: the card's (tiles_for)."""
    m, k = x.shape
    n = w.shape[0]
    launch = linear_launch(m, k, w2 is not None, tiles or tiles_for(x.device))
    grid = (triton.cdiv(m, launch["BM"]), triton.cdiv(n, launch["BN"]))
    _linear_kernel[grid](x, w, w2 if w2 is not None else w, norm if norm is not None else w,
                         resid if resid is not None else y, y, m, n, k, eps, LINEAR_PRECISION,
                         NORM=norm is not None, RESID=resid is not None, SWIGLU=w2 is not None, **launch)
    return y


@triton.jit
def _rotated(x_ptr, rows, stride, col, cos_ptr, sin_ptr, mask, D2: tl.constexpr):
    """One head's vectors at `rows` (columns col .. col+2*D2 of a row-major buffer), rotated
    as remote_drafter.models.llama_layers.rotate does: halves (x1 c - x2 s, x2 c + x1 s), tables by row."""
    rh = tl.arange(0, D2)
    m = mask[:, None]
    x1 = tl.load(x_ptr + rows * stride + col + rh[None, :], mask=m, other=0.0)
    x2 = tl.load(x_ptr + rows * stride + col + D2 + rh[None, :], mask=m, other=0.0)
    c = tl.load(cos_ptr + rows * D2 + rh[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + rows * D2 + rh[None, :], mask=m, other=0.0)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _scores(q1, q2, k1, k2, scale):
    return (tl.dot(q1, tl.trans(k1), input_precision="ieee")
            + tl.dot(q2, tl.trans(k2), input_precision="ieee")) * scale


@triton.jit
def _context_scores(q1, q2, kv_ptr, cos_c_ptr, sin_c_ptr, valid_ptr, b, g, c0, C, scale,
                    KV2: tl.constexpr, D: tl.constexpr, BC: tl.constexpr):
    """Scores of the (rotated) queries against context keys c0 .. c0+BC of kv head g, -inf
    where a position is not valid; also the tile's row offsets (for its values)."""
    rc = c0 + tl.arange(0, BC)
    cm = rc < C
    ok = tl.load(valid_ptr + b * C + rc, mask=cm, other=0) != 0
    rows = (b * C + rc)[:, None]
    k1, k2 = _rotated(kv_ptr, rows, KV2, g * D, cos_c_ptr, sin_c_ptr, cm, D // 2)
    s = _scores(q1, q2, k1, k2, scale)
    return tl.where(ok[None, :], s, float("-inf")), rows, cm


@triton.jit
def _attention_kernel(qkv_ptr, kv_ptr, cos_c_ptr, sin_c_ptr, cos_b_ptr, sin_b_ptr, valid_ptr,
                      o_ptr, p_ptr, C, W, scale,
                      H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, WP: tl.constexpr,
                      BC: tl.constexpr, PROBS: tl.constexpr):
    """One (request, head): the block's W queries over [context; block] keys, online softmax
    (context tiles, then the block's own keys, all of them: bidirectional). RoPE is applied
    on load from cos/sin tables. With PROBS the normalised probabilities are written too
    (the gate's stage zero; the serving path leaves them out)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (H // KVH)
    D2: tl.constexpr = D // 2
    QKV: tl.constexpr = (H + 2 * KVH) * D
    KV2: tl.constexpr = 2 * KVH * D
    rw = tl.arange(0, WP)
    wm = rw < W
    rd = tl.arange(0, D)
    qrow = (b * W + rw)[:, None]
    q1, q2 = _rotated(qkv_ptr, qrow, QKV, h * D, cos_b_ptr, sin_b_ptr, wm, D2)
    m = tl.full([WP], -1.0e30, tl.float32)  # finite: a fully masked tile must not give inf - inf
    denom = tl.zeros([WP], tl.float32)
    acc = tl.zeros([WP, D], tl.float32)
    for c0 in range(0, C, BC):
        s, krow, cm = _context_scores(q1, q2, kv_ptr, cos_c_ptr, sin_c_ptr, valid_ptr, b, g, c0, C, scale,
                                      KV2, D, BC)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptr + krow * KV2 + KVH * D + g * D + rd[None, :], mask=cm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    # the block's own keys (every one visible to every query)
    kr = tl.arange(0, WP)
    km = kr < W
    krow = (b * W + kr)[:, None]
    k1, k2 = _rotated(qkv_ptr, krow, QKV, H * D + g * D, cos_b_ptr, sin_b_ptr, km, D2)
    sb = _scores(q1, q2, k1, k2, scale)
    sb = tl.where(km[None, :], sb, float("-inf"))
    m_new = tl.maximum(m, tl.max(sb, 1))
    p = tl.exp(sb - m_new[:, None])
    alpha = tl.exp(m - m_new)
    denom = denom * alpha + tl.sum(p, 1)
    v = tl.load(qkv_ptr + krow * QKV + (H + KVH) * D + g * D + rd[None, :], mask=km[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    m = m_new
    tl.store(o_ptr + qrow * (H * D) + h * D + rd[None, :], acc / denom[:, None], mask=wm[:, None])
    if PROBS:  # second pass over the keys with the final max and sum: [B, H, W, C + W]
        # (own names: a loop-carried variable may not change shape in the compiled kernel)
        prow = ((b * H + h) * W + rw)[:, None] * (C + W)
        for p0 in range(0, C, BC):
            ps, _, pm = _context_scores(q1, q2, kv_ptr, cos_c_ptr, sin_c_ptr, valid_ptr, b, g, p0, C, scale,
                                        KV2, D, BC)
            pc = p0 + tl.arange(0, BC)
            tl.store(p_ptr + prow + pc[None, :], tl.exp(ps - m[:, None]) / denom[:, None],
                     mask=wm[:, None] & pm[None, :])
        tl.store(p_ptr + prow + C + kr[None, :], tl.exp(sb - m[:, None]) / denom[:, None],
                 mask=wm[:, None] & km[None, :])


def attention_launch(block: int, window: int, tiles: Tiles) -> dict:
    """The attention kernel's tiles and launch options for `block` queries over `window` keys."""
    return {"WP": _pow2(block), "BC": min(tiles.keys, _pow2(window)), "num_warps": tiles.attention_warps}


def attention(qkv, kv, cos_c, sin_c, cos_b, sin_b, valid, out, probs, *, batch: int, heads: int,
              kv_heads: int, head_dim: int, block: int, window: int, tiles: Tiles | None = None) -> torch.Tensor:
    """qkv [B*W, (H+2KVH)*D] (block q|k|v), kv [B*C, 2*KVH*D] (context k|v), cos/sin [B*C or
    B*W, D/2], valid [B, C] bool -> out [B*W, H*D]; probs [B, H, W, C+W] or None; `tiles`:
    the card's (tiles_for)."""
    _attention_kernel[(batch, heads)](qkv, kv, cos_c, sin_c, cos_b, sin_b, valid.view(torch.uint8),
                                      out, probs if probs is not None else out, window, block,
                                      head_dim ** -0.5, H=heads, KVH=kv_heads, D=head_dim,
                                      PROBS=probs is not None,
                                      **attention_launch(block, window, tiles or tiles_for(qkv.device)))
    return out


@triton.jit
def _markov_kernel(z_ptr, prev_ptr, prev_stride, w1_ptr, w2_ptr, out_ptr, best_v_ptr, best_i_ptr,
                   V, z_stride, out_stride, R, RP: tl.constexpr, BV: tl.constexpr):
    """out[b, v] = z[b, v] + W2[v] . W1[prev[b]] in float32, and this tile's max and its
    first index (for the argmax across tiles)."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    prev = tl.load(prev_ptr + b * prev_stride)
    rr = tl.arange(0, RP)
    rm = rr < R
    e = tl.load(w1_ptr + prev * R + rr, mask=rm, other=0.0).to(tl.float32)
    rv = t * BV + tl.arange(0, BV)
    vm = rv < V
    w2 = tl.load(w2_ptr + rv[:, None] * R + rr[None, :], mask=vm[:, None] & rm[None, :], other=0.0)
    logit = tl.load(z_ptr + b * z_stride + rv, mask=vm, other=0.0) + tl.sum(w2.to(tl.float32) * e[None, :], 1)
    tl.store(out_ptr + b * out_stride + rv, logit, mask=vm)
    logit = tl.where(vm, logit, float("-inf"))
    best = tl.max(logit, 0)
    first = tl.min(tl.where(logit == best, rv, V), 0)
    # a NaN logit makes the tile win with an impossible index (max() may skip NaN)
    broken = tl.max(tl.where(logit != logit, 1, 0), 0) > 0
    best = tl.where(broken, float("inf"), best)
    first = tl.where(broken, V, first)
    nt = tl.num_programs(1)
    tl.store(best_v_ptr + b * nt + t, best)
    tl.store(best_i_ptr + b * nt + t, first)


@triton.jit
def _argmax_kernel(best_v_ptr, best_i_ptr, tok_ptr, tok_stride, NT, V, NTP: tl.constexpr):
    """token[b] = the first index of the largest logit (torch.argmax's choice); a NaN logit
    gives V, an impossible token the gate reports."""
    b = tl.program_id(0)
    rt = tl.arange(0, NTP)
    tm = rt < NT
    v = tl.load(best_v_ptr + b * NT + rt, mask=tm, other=float("-inf"))
    i = tl.load(best_i_ptr + b * NT + rt, mask=tm, other=V)
    best = tl.max(v, 0)
    tl.store(tok_ptr + b * tok_stride, tl.min(tl.where(v == best, i, V), 0))


MARKOV_BV = 256


def markov(z, previous, w1, w2, out, best_v, best_i, tokens=None) -> torch.Tensor:
    """out [B, V] = z [B, V] (row stride any) + W2 W1[previous]; previous [B] int64 (any
    stride); tokens [B] (any stride): the argmax of out, when given. best_v/best_i are
    scratch [B, ceil(V / 256)]."""
    b, v = out.shape
    nt = triton.cdiv(v, MARKOV_BV)
    _markov_kernel[(b, nt)](z, previous, previous.stride(0), w1, w2, out, best_v, best_i, v,
                            z.stride(0), out.stride(0), w1.shape[1], RP=_pow2(w1.shape[1], 1),
                            BV=MARKOV_BV, num_warps=4)
    if tokens is not None:
        _argmax_kernel[(b,)](best_v, best_i, tokens, tokens.stride(0), nt, v, NTP=_pow2(nt, 1),
                             num_warps=4)
    return out
