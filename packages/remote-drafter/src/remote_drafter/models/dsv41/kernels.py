"""The drafter round's Triton kernels, in place of torch launches that each do little:

* hc_pre / hc_post: the hyper-connection mix (mHC) of one sublayer (modules/mix.py), for
  the many small launches of the torch code (most of them the Sinkhorn iterations). hc_pre
  is two kernels: the stream's products with hc_*_fn and its sum of squares, split over
  slices of K*H so that a batch of one row still fills the GPU (each slice's partial sums
  written apart, no atomics: the same result every run); then one program per row adds the
  slices' partials in a fixed order, computes the pre and post weights and the K x K mix
  normalised by Sinkhorn in registers, the collapse and its RMS norm. hc_post is one
  program per (row, slice of H): residual = comb^T residual + post x out.
* rope and rms_norm: a row's GPT-J rotation (cos/sin from the model's own inv_freq table)
  and its RMS norm, one program a row, for a dozen and half a dozen launches in torch.
* route: a MoE layer's router after its product with the gate (scores, the bias that
  steers the choice, the top k, the chosen scores renormalised and scaled), one program a
  row, for some ten launches in torch.
* top_two: the greedy chain's two likeliest tokens and their probabilities over the whole
  vocabulary, split over many programs per row then combined, for torch's single-row
  reductions (pick.top_two), which leave most of the GPU idle at batch 1.
* attend: a layer's attention over the window (scores, padding, the heads' sinks, softmax,
  the weighted keys), the softmax carried online over steps of keys, for a dozen launches in
  torch (casts, two batched products, the mask, the sink's column, the softmax). It can also
  split the keys over several programs a block of query rows, each writing its partial
  softmax, joined by a second kernel: more programs where a small batch leaves SMs idle;
  its weighted sum can run on the tensor cores (tf32x3). Which form serves at each batch is
  timed at start-up (ATTEND_VARIANTS; Dsv41Model.choose_attention).

The same arithmetic as the torch code in float32, in another order of summation: equal to
it within float32 rounding (tests/test_dsv41_kernels.py, under Triton's CPU interpreter in
CI and compiled on the GPU tier); Dsv41Model.use_kernels checks them on the model itself
before they serve. Imported only where used: Triton decides between interpreter and
compiler when a kernel is defined."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COLLAPSE_CARRIED, COLLAPSE_OWN, COLLAPSE_FIRST = 0, 1, 2  # which weights collapse the copies


@triton.jit
def _hc_mix_part_kernel(res_ptr, fn_ptr, part_ptr, KH: tl.constexpr, MIX: tl.constexpr,
                        MIXP: tl.constexpr, SLICE: tl.constexpr, SLICES: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Program (row, slice): the slice's products with every row of fn [MIX, K*H] and its
    sum of squares -> part[row, slice, :MIX] and part[row, slice, MIX]."""
    r, s = tl.program_id(0), tl.program_id(1)
    m = tl.arange(0, MIXP)
    mm = m < MIX
    dots = tl.zeros([MIXP, BLOCK], tl.float32)
    sq = tl.zeros([BLOCK], tl.float32)
    for start in range(s * SLICE, s * SLICE + SLICE, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        om = offs < KH
        v = tl.load(res_ptr + r * KH + offs, mask=om, other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + m[:, None] * KH + offs[None, :], mask=mm[:, None] & om[None, :], other=0.0)
        dots += f * v[None, :]
        sq += v * v
    out = part_ptr + (r * SLICES + s) * (MIX + 1)
    tl.store(out + m, tl.sum(dots, 1), mask=mm)
    tl.store(out + MIX, tl.sum(sq, 0))


@triton.jit
def _hc_pre_kernel(res_ptr, part_ptr, scale_ptr, base_ptr, carried_ptr, norm_ptr,
                   x_ptr, post_ptr, comb_ptr, pre_ptr, eps, hc_eps, alpha,
                   H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, MIX: tl.constexpr,
                   SLICES: tl.constexpr, SP: tl.constexpr, ITERS: tl.constexpr,
                   COLLAPSE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = res_ptr + r * K * H
    # the slices' partials, added in slice order: the mixes are (x . fn) / rms(x)
    sl = tl.arange(0, SP)
    slm = sl < SLICES
    parts = part_ptr + (r * SLICES + sl) * (MIX + 1)
    inv = tl.rsqrt(tl.sum(tl.load(parts + MIX, mask=slm, other=0.0), 0) / (K * H) + eps)
    k = tl.arange(0, KP)
    km = k < K
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    both = slm[:, None] & km[None, :]
    pre_raw = tl.sum(tl.load(parts[:, None] + k[None, :], mask=both, other=0.0), 0)
    post_raw = tl.sum(tl.load(parts[:, None] + K + k[None, :], mask=both, other=0.0), 0)
    pre = tl.sigmoid((pre_raw * inv) * s0 + tl.load(base_ptr + k, mask=km, other=0.0)) + hc_eps
    post = tl.sigmoid((post_raw * inv) * s1 + tl.load(base_ptr + K + k, mask=km, other=0.0)) * alpha
    tl.store(pre_ptr + r * K + k, pre, mask=km)
    tl.store(post_ptr + r * K + k, post, mask=km)
    # comb: softmax over each row of the K x K mix, then Sinkhorn (columns, then rows/columns)
    ij = k[:, None] * K + k[None, :]
    ijm = km[:, None] & km[None, :]
    comb_raw = tl.sum(tl.load(parts[:, None, None] + 2 * K + ij[None, :, :],
                              mask=slm[:, None, None] & ijm[None, :, :], other=0.0), 0)
    logit = (comb_raw * inv) * s2 + tl.load(base_ptr + 2 * K + ij, mask=ijm, other=0.0)
    logit = tl.where(ijm, logit, float("-inf"))
    e = tl.exp(logit - tl.max(logit, 1)[:, None])
    comb = tl.where(ijm, e / tl.sum(e, 1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, 1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
    tl.store(comb_ptr + r * K * K + ij, comb, mask=ijm)
    # collapse the copies, in the stream's dtype, then RMS-norm it
    if COLLAPSE == 0:
        w = tl.load(carried_ptr + r * K + k, mask=km, other=0.0)
    elif COLLAPSE == 1:
        w = pre
    else:
        w = tl.where(k == 0, 1.0, 0.0)
    h = tl.arange(0, BLOCK)
    sq = tl.zeros([BLOCK], tl.float32)
    for start in range(0, H, BLOCK):
        hm = start + h < H
        tile = tl.load(row + k[:, None] * H + start + h[None, :], mask=km[:, None] & hm[None, :], other=0.0)
        c = tl.sum(w[:, None] * tile.to(tl.float32), 0).to(x_ptr.dtype.element_ty).to(tl.float32)
        sq += c * c
    rms = tl.rsqrt(tl.sum(sq, 0) / H + eps)
    for start in range(0, H, BLOCK):
        hm = start + h < H
        tile = tl.load(row + k[:, None] * H + start + h[None, :], mask=km[:, None] & hm[None, :], other=0.0)
        c = tl.sum(w[:, None] * tile.to(tl.float32), 0).to(x_ptr.dtype.element_ty).to(tl.float32)
        g = tl.load(norm_ptr + start + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(x_ptr + r * H + start + h, ((c * rms) * g).to(x_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _hc_post_kernel(res_ptr, out_ptr, post_ptr, comb_ptr, new_ptr,
                    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    r, part = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, KP)
    km = k < K
    h = part * BLOCK + tl.arange(0, BLOCK)
    hm = h < H
    both = km[:, None] & hm[None, :]
    res = tl.load(res_ptr + r * K * H + k[:, None] * H + h[None, :], mask=both, other=0.0).to(tl.float32)
    comb = tl.load(comb_ptr + r * K * K + k[:, None] * K + k[None, :], mask=km[:, None] & km[None, :], other=0.0)
    mixed = tl.sum(comb[:, :, None] * res[:, None, :], 0)  # [j, h] = sum_i comb[i, j] res[i, h]
    post = tl.load(post_ptr + r * K + k, mask=km, other=0.0)
    out = tl.load(out_ptr + r * H + h, mask=hm, other=0.0).to(tl.float32)
    new = mixed + post[:, None] * out[None, :]
    tl.store(new_ptr + r * K * H + k[:, None] * H + h[None, :], new.to(new_ptr.dtype.element_ty), mask=both)


MIX_SLICE = 1024  # stream values per program of the mixes' products
MIX_BLOCK = 128  # of them at a time: [MIX, MIX_BLOCK] of fn in registers


def hc_pre(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           carried: torch.Tensor | None, collapse: int, norm: torch.Tensor, eps: float,
           hc_eps: float, alpha: float, iters: int):
    """residual [..., K, H], fn [(2 + K) K, K*H] (float32) -> (normed collapse [..., H] in
    residual's dtype, post [..., K], comb [..., K, K], pre [..., K])."""
    *lead, k, h = residual.shape
    rows = residual.reshape(-1, k, h).contiguous()
    n, dev, f32 = rows.shape[0], residual.device, torch.float32
    mix, slice_ = fn.shape[0], min(MIX_SLICE, triton.next_power_of_2(k * h))
    slices = triton.cdiv(k * h, slice_)
    parts = torch.empty(n, slices, mix + 1, dtype=f32, device=dev)
    _hc_mix_part_kernel[(n, slices)](rows, fn.contiguous(), parts, KH=k * h, MIX=mix,
                                     MIXP=triton.next_power_of_2(mix), SLICE=slice_, SLICES=slices,
                                     BLOCK=min(MIX_BLOCK, slice_))
    x = torch.empty(n, h, dtype=residual.dtype, device=dev)
    post, pre = torch.empty(n, k, dtype=f32, device=dev), torch.empty(n, k, dtype=f32, device=dev)
    comb = torch.empty(n, k, k, dtype=f32, device=dev)
    carried = pre if carried is None else carried.reshape(n, k).to(f32).contiguous()
    _hc_pre_kernel[(n,)](rows, parts, scale, base, carried, norm,
                         x, post, comb, pre, eps, hc_eps, alpha, H=h, K=k,
                         KP=triton.next_power_of_2(k), MIX=mix, SLICES=slices,
                         SP=triton.next_power_of_2(slices), ITERS=iters,
                         COLLAPSE=collapse, BLOCK=min(1024, triton.next_power_of_2(h)))
    return (x.view(*lead, h), post.view(*lead, k), comb.view(*lead, k, k), pre.view(*lead, k))


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """comb^T residual + post x out, in residual's dtype: [..., K, H]."""
    *lead, k, h = residual.shape
    rows = residual.reshape(-1, k, h).contiguous()
    n = rows.shape[0]
    new = torch.empty_like(rows)
    block = min(256, triton.next_power_of_2(h))
    _hc_post_kernel[(n, triton.cdiv(h, block))](
        rows, out.reshape(n, h).contiguous(), post.reshape(n, k).to(torch.float32).contiguous(),
        comb.reshape(n, k, k).to(torch.float32).contiguous(), new,
        H=h, K=k, KP=triton.next_power_of_2(k), BLOCK=block)
    return new.view(*lead, k, h)


@triton.jit
def _top_two_part_kernel(x_ptr, b_ptr, part_ptr, V, XS, BS, PARTS: tl.constexpr, BLOCK: tl.constexpr,
                         BIAS: tl.constexpr):
    """Program (row, part): its slice's best and second values and tokens, and the sum of
    exp(x - best) over the slice; x is the row (XS apart) plus, with BIAS, the bias row (BS
    apart) in float32, one rounding as torch's add."""
    r, part = tl.program_id(0), tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    row = r.to(tl.int64)  # rows W x V apart (a block's) pass 2**31 elements at a few thousand
    x = tl.load(x_ptr + row * XS + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if BIAS:
        x = x + tl.load(b_ptr + row * BS + offs, mask=offs < V, other=0.0).to(tl.float32)
    v1, i1 = tl.max(x, 0, return_indices=True)
    v2, i2 = tl.max(tl.where(tl.arange(0, BLOCK) == i1, float("-inf"), x), 0, return_indices=True)
    total = tl.where(v1 == float("-inf"), 0.0, tl.sum(tl.exp(x - v1), 0))  # an all -inf slice adds 0
    out = part_ptr + (r * PARTS + part) * 5
    tl.store(out, v1)
    tl.store(out + 1, v2)
    tl.store(out + 2, (part * BLOCK + i1).to(tl.float32))  # exact: top_two checks V < 2**24
    tl.store(out + 3, (part * BLOCK + i2).to(tl.float32))
    tl.store(out + 4, total)


@triton.jit
def _top_two_join_kernel(part_ptr, p_ptr, i_ptr, PARTS: tl.constexpr, PP: tl.constexpr):
    """Program row: the best over the parts' bests; the second is the runner-up of the
    winning part or another part's best; probabilities over the joined sum."""
    r = tl.program_id(0)
    s = tl.arange(0, PP)
    sm = s < PARTS
    base = part_ptr + (r * PARTS + s) * 5
    v1 = tl.load(base, mask=sm, other=float("-inf"))
    v2 = tl.load(base + 1, mask=sm, other=float("-inf"))
    i1 = tl.load(base + 2, mask=sm, other=0.0)
    i2 = tl.load(base + 3, mask=sm, other=0.0)
    total = tl.load(base + 4, mask=sm, other=0.0)
    best, win = tl.max(v1, 0, return_indices=True)  # ties: the lowest part, i.e. the lowest token
    norm = tl.sum(tl.where(sm, total * tl.exp(v1 - best), 0.0), 0)
    first = tl.sum(tl.where(s == win, i1, 0.0), 0)
    # the runner-up: the winning part's second, or the best of any other part
    other = tl.where(s == win, v2, v1)
    other_i = tl.where(s == win, i2, i1)
    second, at = tl.max(other, 0, return_indices=True)
    second_i = tl.sum(tl.where(s == at, other_i, 0.0), 0)
    tl.store(p_ptr + r * 2, 1.0 / norm)
    tl.store(p_ptr + r * 2 + 1, tl.exp(second - best) / norm)
    tl.store(i_ptr + r * 2, first.to(tl.int64))
    tl.store(i_ptr + r * 2 + 1, second_i.to(tl.int64))


TOP_TWO_BLOCK = 4096  # vocabulary slice per program


def _rows_in_place(t: torch.Tensor) -> torch.Tensor:
    """t itself when each row is contiguous (rows may lie apart: the kernel takes a row
    stride), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def top_two(logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (+ bias [B, V], added in float32 as it is read) -> (top two
    probabilities [B, 2] float32, their tokens [B, 2] int64), as pick.top_two at temperature
    1 of logits + bias.float(). Rows may lie apart (a block's row of logits): no copy."""
    rows, vocab = logits.shape
    if vocab >= 1 << 24:
        raise ValueError(f"a vocabulary of {vocab} tokens: token ids pass through float32, exact below 2**24")
    if bias is not None and bias.shape != logits.shape:
        raise ValueError(f"a bias of shape {tuple(bias.shape)} for logits of shape {tuple(logits.shape)}")
    x = _rows_in_place(logits)
    b = x if bias is None else _rows_in_place(bias)
    parts = triton.cdiv(vocab, TOP_TWO_BLOCK)
    scratch = torch.empty(rows, parts, 5, dtype=torch.float32, device=x.device)
    probs = torch.empty(rows, 2, dtype=torch.float32, device=x.device)
    tokens = torch.empty(rows, 2, dtype=torch.int64, device=x.device)
    _top_two_part_kernel[(rows, parts)](x, b, scratch, vocab, x.stride(0), b.stride(0), PARTS=parts,
                                        BLOCK=TOP_TWO_BLOCK, BIAS=bias is not None)
    _top_two_join_kernel[(rows,)](scratch, probs, tokens, PARTS=parts, PP=triton.next_power_of_2(parts))
    return probs, tokens


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, inv_ptr, out_ptr, D: tl.constexpr, DIMS: tl.constexpr,
                 G: tl.constexpr, SIGN: tl.constexpr, KEEP: tl.constexpr):
    """Row r (of G rows per position): its first D - DIMS values as they are, its last DIMS
    rotated pairwise (even, odd) by position x inv_freq (SIGN -1: back)."""
    r = tl.program_id(0)
    row = r * D
    if KEEP > 0:
        k = tl.arange(0, KEEP)
        km = k < D - DIMS
        tl.store(out_ptr + row + k, tl.load(x_ptr + row + k, mask=km), mask=km)
    i = tl.arange(0, DIMS // 2)
    angle = tl.load(pos_ptr + r // G).to(tl.float32) * tl.load(inv_ptr + i)
    cos, sin = tl.cos(angle), tl.sin(angle) * SIGN
    at = row + D - DIMS + 2 * i
    even = tl.load(x_ptr + at).to(tl.float32)
    odd = tl.load(x_ptr + at + 1).to(tl.float32)
    kind = out_ptr.dtype.element_ty
    tl.store(out_ptr + at, (even * cos - odd * sin).to(kind))
    tl.store(out_ptr + at + 1, (odd * cos + even * sin).to(kind))


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [..., D] at positions [...] (x.shape[:-1], or x.shape[:-2]: one position for all of
    a row's heads) -> x with its last 2 * len(inv_freq) dims rotated, as model.rope."""
    d, dims = x.shape[-1], 2 * inv_freq.numel()
    x = x.contiguous()
    rows = x.numel() // d
    out = torch.empty_like(x)
    keep = d - dims
    _rope_kernel[(rows,)](x, positions.contiguous(), inv_freq, out, D=d, DIMS=dims,
                          G=rows // positions.numel(), SIGN=-1 if inverse else 1,
                          KEEP=triton.next_power_of_2(keep) if keep else 0)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr, WEIGHT: tl.constexpr):
    r = tl.program_id(0)
    h = tl.arange(0, BLOCK)
    m = h < D
    x = tl.load(x_ptr + r * D + h, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if WEIGHT:
        y = y * tl.load(w_ptr + h, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * D + h, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """As model.rms_norm in float32: x * rsqrt(mean(x^2) + eps) (* weight), in x's dtype."""
    d = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.numel() // d,)](x, x if weight is None else weight, out, eps, D=d,
                                         BLOCK=triton.next_power_of_2(d), WEIGHT=weight is not None)
    return out


SCORES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}  # the router's scoring functions


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, experts_ptr, E, scale, K: tl.constexpr, KP: tl.constexpr,
                  EP: tl.constexpr, SCORE: tl.constexpr, BIAS: tl.constexpr, NORM: tl.constexpr):
    """Row r: scores of its E logits (SCORE: sqrt(softplus), sigmoid or softmax, in float32),
    the K largest of score + bias (BIAS) in descending order (ties: the lowest expert), their
    scores (NORM: over their sum) times scale."""
    r = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    live = e < E
    x = tl.load(logits_ptr + r * E + e, mask=live, other=0.0).to(tl.float32)
    if SCORE == 0:  # softplus as torch's: x past 20, else log1p(exp(x)) (Goldberg's log1p)
        y = tl.exp(tl.minimum(x, 20.0))
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
        score = tl.sqrt(tl.where(x > 20.0, x, log1p))
    elif SCORE == 1:
        score = tl.sigmoid(x)
    else:
        p = tl.where(live, tl.exp(x - tl.max(tl.where(live, x, float("-inf")), 0)), 0.0)
        score = p / tl.sum(p, 0)
    choose = score
    if BIAS:
        choose = score + tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32)
    choose = tl.where(live, choose, float("-inf"))
    j = tl.arange(0, KP)
    chosen = tl.zeros([KP], tl.int64)
    weights = tl.zeros([KP], tl.float32)
    for t in tl.static_range(K):
        _, at = tl.max(choose, 0, return_indices=True)
        chosen = tl.where(j == t, at.to(tl.int64), chosen)
        weights = tl.where(j == t, tl.sum(tl.where(e == at, score, 0.0), 0), weights)
        choose = tl.where(e == at, float("-inf"), choose)
    if NORM:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + r * K + j, weights * scale, mask=j < K)
    tl.store(experts_ptr + r * K + j, chosen, mask=j < K)


def route(logits: torch.Tensor, bias: torch.Tensor | None, k: int, scoring: str, norm: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] (the rows' products with the gate, any float dtype) -> (routing weights
    [N, k] float32, chosen experts [N, k] int64), as MoE.route in float32."""
    n, experts = logits.shape
    logits = logits.contiguous()
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    chosen = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    _route_kernel[(n,)](logits, logits if bias is None else bias, weights, chosen, experts, float(scale), K=k,
                        KP=triton.next_power_of_2(k), EP=triton.next_power_of_2(experts), SCORE=SCORES[scoring],
                        BIAS=bias is not None, NORM=norm)
    return weights, chosen


ATTEND_ROWS, ATTEND_KEYS, ATTEND_WARPS = 16, 16, 8  # (position, head) rows and keys a step; warps
# The forms of `attend` a round may run, its defaults first: Dsv41Model.choose_attention times
# those that match torch at start-up, per batch (REMOTE_DRAFTER_ATTENTION=auto), and
# benchmarks/attention_variants.py times them all (tests/gpu_kernels.py compiles each: other
# warps or key steps spill registers at the Flash drafter's head size)
ATTEND_VARIANTS = {"default": {}, "tf32x3": {"weighted_sum": "tf32x3"},
                   **{f"{s} splits": {"splits": s} for s in (2, 3, 5, 9)},
                   **{f"{s} splits, tf32x3": {"splits": s, "weighted_sum": "tf32x3"} for s in (3, 9)}}
NO_SCORE = tl.constexpr(-1e30)  # a split's running maximum before its first visible key (finite: no inf - inf)


@triton.jit
def _attend_kernel(q_ptr, ctx_ptr, new_ptr, unseen_ptr, sink_ptr, out_ptr, m_ptr, l_ptr, C, W, CS_B, CS_C,
                   scale, SPLIT_KEYS, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                   BK: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, SUM: tl.constexpr):
    """Program (request b, block of BM of its W·H query rows, (position, head) in q's order,
    split s of the keys): softmax over [the keys' scores ; the head's sink] times the keys
    (which are the values), the keys its C context rows (row stride CS_C, request stride
    CS_B) then its W new ones, those `unseen` left out; BK keys a step, the softmax carried
    online. SPLIT: the program takes SPLIT_KEYS of the keys and writes its running maximum,
    sum and unnormalised weighted keys (m, l, out in float32) for _attend_join_kernel, which
    adds the sink; else it takes them all. The scores' products are exact (bf16 values) and
    summed in float32 on the tensor cores (IEEE: in float32 without them, for a float32
    model's rows, where TF32 would round them, and in Triton's CPU interpreter, whose bf16
    products are wrong); the weighted sum is float32 (SUM: its dot's input precision)."""
    b, blk, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    rows = blk * BM + tl.arange(0, BM)
    live = rows < W * H
    d = tl.arange(0, DP)
    dm = d < D
    q = tl.load(q_ptr + (b * W * H + rows[:, None]) * D + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
    n = C + W
    if SPLIT:
        first, last = split * SPLIT_KEYS, tl.minimum(split * SPLIT_KEYS + SPLIT_KEYS, n)
        top = tl.full([BM], NO_SCORE, tl.float32)
        total = tl.zeros([BM], tl.float32)
    else:
        first, last = 0, n
        top = tl.load(sink_ptr + rows % H, mask=live, other=0.0).to(tl.float32)  # a logit with no value
        total = tl.full([BM], 1.0, tl.float32)  # the sink's exp(sink - top)
    acc = tl.zeros([BM, DP], tl.float32)
    for k0 in range(first, last, BK):
        k = k0 + tl.arange(0, BK)
        old, new = k < C, (k >= C) & (k < last)
        keys = tl.where(old[:, None],
                        tl.load(ctx_ptr + b * CS_B + k[:, None] * CS_C + d[None, :],
                                mask=(old & (k < last))[:, None] & dm[None, :], other=0.0),
                        tl.load(new_ptr + (b * W + k[:, None] - C) * D + d[None, :], mask=new[:, None] & dm[None, :],
                                other=0.0))
        hidden = tl.load(unseen_ptr + b * n + k, mask=k < last, other=1) != 0
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(keys)) * scale
        s = tl.where(hidden[None, :], float("-inf"), s)
        top_next = tl.maximum(top, tl.max(s, 1))
        kept = tl.exp(top - top_next)
        p = tl.exp(s - top_next[:, None])
        total = total * kept + tl.sum(p, 1)
        acc = acc * kept[:, None] + tl.dot(p, keys.to(tl.float32), input_precision=SUM)
        top = top_next
    if SPLIT:
        at = (b * tl.num_programs(2) + split) * W * H + rows
        tl.store(m_ptr + at, top, mask=live)
        tl.store(l_ptr + at, total, mask=live)
        tl.store(out_ptr + at[:, None] * D + d[None, :], acc, mask=live[:, None] & dm[None, :])
    else:
        o = acc / total[:, None]
        tl.store(out_ptr + (b * W * H + rows[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & dm[None, :])


@triton.jit
def _attend_join_kernel(part_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, W, SPLITS, H: tl.constexpr, D: tl.constexpr,
                        DP: tl.constexpr, BM: tl.constexpr):
    """Program (request b, block of BM query rows): the splits' partial softmaxes joined, in
    split order, with the head's sink, then normalised."""
    b, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows = blk * BM + tl.arange(0, BM)
    live = rows < W * H
    d = tl.arange(0, DP)
    dm = d < D
    top = tl.load(sink_ptr + rows % H, mask=live, other=0.0).to(tl.float32)
    total = tl.full([BM], 1.0, tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    for split in range(0, SPLITS):
        at = (b * SPLITS + split) * W * H + rows
        m = tl.load(m_ptr + at, mask=live, other=NO_SCORE)
        top_next = tl.maximum(top, m)
        kept, weight = tl.exp(top - top_next), tl.exp(m - top_next)
        total = total * kept + tl.load(l_ptr + at, mask=live, other=0.0) * weight
        part = tl.load(part_ptr + at[:, None] * D + d[None, :], mask=live[:, None] & dm[None, :], other=0.0)
        acc = acc * kept[:, None] + part * weight[:, None]
        top = top_next
    o = acc / total[:, None]
    tl.store(out_ptr + (b * W * H + rows[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & dm[None, :])


def attend(q: torch.Tensor, ctx: torch.Tensor, new: torch.Tensor, unseen: torch.Tensor,
           sink: torch.Tensor, splits: int = 1, weighted_sum: str = "ieee") -> torch.Tensor:
    """As Numerics.attend in float32, in one launch: q [B, W, H, D], keys ctx [B, C, D] (rows
    may be strided: one layer's of the windows) and new [B, W, D], unseen [B, C + W] bool,
    sink [H] -> [B, W, H, D] in q's dtype. splits > 1: the keys split over that many programs
    a block of query rows (more programs where the batch is small), joined by a second
    launch; weighted_sum: the input precision of its dot on bf16 rows on a GPU ("ieee", or "tf32x3": on the tensor cores). ATTEND_VARIANTS
    names the forms a round may run."""
    b, w, h, d = q.shape
    q, new, ctx = q.contiguous(), new.to(q.dtype).contiguous(), ctx.to(q.dtype)  # casts as torch's
    if ctx.stride(-1) != 1:
        ctx = ctx.contiguous()
    n = ctx.shape[1] + w
    split_keys = triton.cdiv(triton.cdiv(n, splits), ATTEND_KEYS) * ATTEND_KEYS  # whole steps a split
    splits = triton.cdiv(n, split_keys)
    blocks = triton.cdiv(w * h, ATTEND_ROWS)
    ieee = q.dtype == torch.float32 or not q.is_cuda
    out = torch.empty_like(q)
    if splits > 1:
        part = torch.empty(b, splits, w * h, d, dtype=torch.float32, device=q.device)
        m, total = (torch.empty(b, splits, w * h, dtype=torch.float32, device=q.device) for _ in range(2))
    else:
        part, m, total = out, out, out  # not written
    _attend_kernel[(b, blocks, splits)](
        q, ctx, new, unseen.contiguous().view(torch.uint8), sink, part, m, total, ctx.shape[1], w, ctx.stride(0),
        ctx.stride(1), d ** -0.5, split_keys, H=h, D=d, DP=triton.next_power_of_2(d), BM=ATTEND_ROWS,
        BK=ATTEND_KEYS, SPLIT=splits > 1, IEEE=ieee, SUM="ieee" if ieee else weighted_sum, num_warps=ATTEND_WARPS)
    if splits > 1:
        _attend_join_kernel[(b, blocks)](part, m, total, sink, out, w, splits, H=h, D=d, DP=triton.next_power_of_2(d),
                                         BM=ATTEND_ROWS, num_warps=ATTEND_WARPS)
    return out
