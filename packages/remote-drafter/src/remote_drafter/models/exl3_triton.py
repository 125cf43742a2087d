"""Triton kernels of our own on exllamav3's stored EXL3 format (exl3_format.py says how it is
laid out): the codebooks' decode, and a grouped product that decodes each expert a call chose
once for every 16 rows that chose it, where exllamav3's coop tier decodes an expert once per
(row, expert) slot. exl3_triton_experts.py builds a MoE layer on it.

The product, for the 4-bit trellis our packs and exllamav3's conversions store (mul1):
out[slot, n] = sum over k of x[slot, k] * decoded W_e[k, n], for the slots [start_e, start_e +
count_e) of every expert e, x already rotated (the Hadamard rotations stay outside). The work
is cut into items of 16 slots of one expert (`work_items`); a program takes one item, NT
16-wide tile columns and a slice of the input (split K: partials written apart, summed by the
caller's next kernel in a fixed order, the same result every run). A step decodes one input
tile's row of NT tiles: a tile's 32 words are its 32 lanes, and lane t's word holds the ends
of weights 8t .. 8t + 7, whose 16-bit states reach back into word t - 1 (most significant bit
first); weight 8t + i sits at row (t % 4)·2 + (0, 1, 8, 9)[i % 4] and column t // 4 + 8·(i // 4)
of its tile. The decoded weights are laid out as the weight's transpose, [NT·16, 16], the
first operand of a product with the item's rows on the tensor cores (tl.dot): that operand
stays in registers on Hopper (wgmma), where the second passes through shared memory every
step, so the rows take that trip and the weights, NT times as many, do not.

On a CPU the kernels run under Triton's interpreter (set TRITON_INTERPRET=1 before this module
is imported: Triton decides between interpreter and compiler when a kernel is defined)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import exl3_format

BITS = 4
ITEM_ROWS = 16  # slots of one expert a program multiplies at once (the tensor cores' M: 16 or more)
NT_DEFAULT, WARPS_DEFAULT = 8, 4  # the product's defaults: tile columns a program, warps
MUL1, MCG = 0, 1  # codebooks (exllamav3's procedural ones; exl3_format.MUL1 / MCG)
PURE, ASM, ASM_VABSDIFF = 0, 1, 2  # the decode's instructions: Triton ops, or inline PTX
_MUL1, _ASM_VABSDIFF = tl.constexpr(MUL1), tl.constexpr(ASM_VABSDIFF)  # a kernel reads a global only as a constexpr

# Inline PTX, a state ($1) to its fp16 weight ($0). mul1: the byte sum plus 0x6400 (dp4a against
# 0x01010101, or vabsdiff4 against 0) whose low half is fp16 1024 + sum, then one fp16 fma; mcg:
# lop3 0x6A is (a & b) ^ c, then the two halves added in fp16.
_MUL1_PTX = """{{
.reg .b32 x, one, z, acc;
.reg .b16 l, h, k, b;
mov.b32 one, 0x01010101;
mov.b32 z, 0;
mov.b32 acc, 0x6400;
mul.lo.u32 x, $1, 0x83DCD12D;
{0} x, x, {1}, acc;
mov.b32 {{l, h}}, x;
mov.b16 k, 0x1EEE;
mov.b16 b, 0xC931;
fma.rn.f16 $0, l, k, b;
}}"""
_MUL1_DP4A = tl.constexpr(_MUL1_PTX.format("dp4a.u32.u32", "one"))
_MUL1_VABSDIFF4 = tl.constexpr(_MUL1_PTX.format("vabsdiff4.u32.u32.u32.add", "z"))
# The same for a pair of states ($1, $2) into one register of two fp16 weights ($0, the first
# in its low half), as the tensor cores take them: both byte sums, their low halves packed by
# one multiply-add (it issues beside the integer pipe, which bounds the decode; a prmt would
# not), then one fp16x2 fma for the two.
_MUL1_PAIR_VABSDIFF4 = tl.constexpr("""{
.reg .b32 x, y, z, acc, k, b;
mov.b32 z, 0;
mov.b32 acc, 0x6400;
mov.b32 k, 0x1EEE1EEE;
mov.b32 b, 0xC931C931;
mul.lo.u32 x, $1, 0x83DCD12D;
mul.lo.u32 y, $2, 0x83DCD12D;
vabsdiff4.u32.u32.u32.add x, x, z, acc;
vabsdiff4.u32.u32.u32.add y, y, z, acc;
mad.lo.u32 x, y, 65536, x;
fma.rn.f16x2 $0, x, k, b;
}""")
_MCG_LOP3 = tl.constexpr("""{
.reg .b32 x, mask, flip;
.reg .b16 l, h;
mov.b32 mask, 0x8FFF8FFF;
mov.b32 flip, 0x3B603B60;
mul.lo.u32 x, $1, 0xCBAC1FED;
lop3.b32 x, x, mask, flip, 0x6A;
mov.b32 {l, h}, x;
add.rn.f16 $0, l, h;
}""")


@triton.jit
def decode(s, CB: tl.constexpr, DECODE: tl.constexpr):
    """fp16 weights of uint32 states s (< 2**16)."""
    if CB == 0:
        if DECODE == 0:
            x = s * 0x83DCD12D
            pairs = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)  # two byte-pair sums
            h = (pairs * 0x10001 + 0x64000000) >> 16  # 0x6400 + both: fp16 bits of 1024 + sum
            # fp32 holds h * scale + bias exactly (22 significant bits): one rounding, as the fma
            f = h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            w = (f * 0.00676727294921875 - 10.3828125).to(tl.float16)
        else:
            w = tl.inline_asm_elementwise(_MUL1_DP4A if DECODE == 1 else _MUL1_VABSDIFF4,
                                          "=h,r", [s], dtype=tl.float16, is_pure=True, pack=1)
    else:
        if DECODE == 0:
            x = s * 0xCBAC1FED
            x = (x & 0x8FFF8FFF) ^ 0x3B603B60
            lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
            hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
            w = lo + hi
        else:
            w = tl.inline_asm_elementwise(_MCG_LOP3, "=h,r", [s], dtype=tl.float16, is_pure=True, pack=1)
    return w


@triton.jit
def _state(cur, prev, J: tl.constexpr):
    """The 16-bit state of weight 8t + J of each lane t's word `cur` (its predecessor in the
    tile `prev`)."""
    shift: tl.constexpr = 28 - 4 * J
    if shift == 0:
        state = cur & 0xFFFF
    else:
        state = ((cur >> shift) | (prev << (32 - shift))) & 0xFFFF
    return state


@triton.jit
def _weights(cur, prev, J: tl.constexpr, DECODE: tl.constexpr):
    """fp16 [..., 2]: weights 8t + J and 8t + J + 1 of each lane t's word (J even): rows r and r + 1
    of one column, the pair a tensor-core register holds (with ASM_VABSDIFF made as one,
    _MUL1_PAIR_VABSDIFF4; otherwise each alone)."""
    a, b = _state(cur, prev, J), _state(cur, prev, J + 1)
    if DECODE == _ASM_VABSDIFF:
        return tl.inline_asm_elementwise(_MUL1_PAIR_VABSDIFF4, "=r,r,r", [tl.join(a, b)], dtype=tl.float16,
                                         is_pure=True, pack=2)
    return tl.join(decode(a, _MUL1, DECODE), decode(b, _MUL1, DECODE))


@triton.jit
def _tiles_as_columns(cur, prev, NT: tl.constexpr, DECODE: tl.constexpr):
    """fp16 [NT·16, 16]: one input tile's row of NT tiles ([NT, 32] words, a lane a word) as the
    weight's NT·16 columns by 16 rows (the weight transposed). Lane t = 4·(column % 8) + row // 2
    % 4 holds weights 8t + 4·(column // 8) + 2·(row // 8) + row % 2 (exl3_format.TILE_ORDER)."""
    low = tl.join(_weights(cur, prev, 0, DECODE), _weights(cur, prev, 2, DECODE))
    high = tl.join(_weights(cur, prev, 4, DECODE), _weights(cur, prev, 6, DECODE))
    w = tl.reshape(tl.join(low, high), [NT, 8, 4, 2, 2, 2])  # [tile, column % 8, row // 2 % 4, row % 2, row // 8, column // 8]
    return tl.reshape(tl.permute(w, [0, 5, 1, 4, 2, 3]), [NT * 16, 16])


@triton.jit
def tile_offsets(TILES: tl.constexpr, NEIGHBOUR: tl.constexpr):
    """The offsets of TILES consecutive tiles' words ([TILES, 32], a tile a row) and of each
    word's neighbour in its tile (NEIGHBOUR 31: the word before, as exllamav3's states reach
    back; 1: the word after). Both loads are declared scalar and contiguous along the tile, so
    that Triton gives them one layout (a lane a word) and the decode converts none through
    shared memory; left alone it vectorises the first and gives the second, which wraps, a
    layout of its own. (The neighbours are not contiguous where they wrap: the claim only
    orders them, as an alignment of 1 keeps every load scalar.)"""
    cols = tl.arange(0, 32)[None, :].to(tl.int64)
    rows = tl.arange(0, TILES)[:, None].to(tl.int64) * 32
    here = tl.multiple_of(rows + cols, [1, 1])
    there = tl.max_contiguous(tl.multiple_of(rows + (cols + NEIGHBOUR) % 32, [1, 1]), [1, 32])
    return here, there


@triton.jit
def _expert_tiles_kernel(x_ptr, experts_ptr, first_rows_ptr, table_ptr, counts_ptr, starts_ptr, out_ptr, slots,
                         in_tiles, out_tiles, tiles_per_split, M: tl.constexpr, NT: tl.constexpr,
                         DECODE: tl.constexpr):
    """Program (column block, item j, split): out[split, slot, 16 n + c] for the item's slots
    (those of expert experts[j] from its first_rows[j]-th, up to M) and the block's NT tile
    columns n, over the split's input tiles; rows past the expert's are zeros in the product.
    The product is accumulated transposed ([NT·16, M]: the weights its first operand)."""
    block, j, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(experts_ptr + j)
    r0 = tl.load(first_rows_ptr + j)
    count = tl.load(counts_ptr + e)
    if r0 < count:  # else a padding item
        start = tl.load(starts_ptr + e)
        trellis = tl.load(table_ptr + e).to(tl.pointer_type(tl.int32)) + block * NT * 32
        in_features, out_features = in_tiles * 16, out_tiles * 16
        here, there = tile_offsets(NT, 31)
        m = tl.arange(0, M)
        live = m + r0 < count
        x_at = x_ptr + (start + r0 + m[None, :]).to(tl.int64) * in_features + tl.arange(0, 16)[:, None]  # rows transposed
        first = split * tiles_per_split
        last = first + tiles_per_split - 1
        acc = tl.zeros([NT * 16, M], tl.float32)
        cur = tl.load(trellis + first * out_tiles * 32 + here).to(tl.uint32, bitcast=True)
        prev = tl.load(trellis + first * out_tiles * 32 + there).to(tl.uint32, bitcast=True)
        for kt in range(first, last + 1):
            # the next step's words requested before this step's work, so that their latency
            # overlaps it (the last step requests its own again); an expert's trellis is far
            # under 2**31 words
            ahead = trellis + tl.minimum(kt + 1, last) * out_tiles * 32
            cur_next = tl.load(ahead + here).to(tl.uint32, bitcast=True)
            prev_next = tl.load(ahead + there).to(tl.uint32, bitcast=True)
            rows = tl.load(x_at + kt * 16, mask=live[None, :], other=0.0)
            acc = tl.dot(_tiles_as_columns(cur, prev, NT, DECODE), rows, acc)
            cur, prev = cur_next, prev_next
        cols = block * NT * 16 + tl.arange(0, NT * 16)[None, :]
        tl.store(out_ptr + (split * slots + start + r0 + m[:, None]).to(tl.int64) * out_features + cols, tl.trans(acc),
                 mask=live[:, None] & (cols >= 0))


def work_items(counts: torch.Tensor, max_items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of every ITEM_ROWS-slot piece of the experts' slots, in expert order,
    then padding items up to max_items (on the device, no host read: a CUDA graph captures it).
    counts: int [experts + 1], each expert's slots, the last a padding expert with none (the
    padding items are its)."""
    chunks = (counts.long() + ITEM_ROWS - 1) // ITEM_ROWS
    ends = chunks.cumsum(0)
    i = torch.arange(max_items, device=counts.device)
    expert = torch.searchsorted(ends, i, right=True).clamp_(max=len(counts) - 1)
    return expert, ((i - (ends - chunks)[expert]) * ITEM_ROWS).int()


def max_items(slots: int, experts: int) -> int:
    """The most work items `slots` slots over `experts` experts can make (a bound known without
    reading the routing: each expert with slots makes one item more than its slots // 16)."""
    return min(slots, experts) + slots // ITEM_ROWS


def expert_products(x: torch.Tensor, items: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor,
                    counts: torch.Tensor, starts: torch.Tensor, in_features: int, out_features: int,
                    splits: int = 1, nt: int = NT_DEFAULT, num_warps: int = WARPS_DEFAULT) -> torch.Tensor:
    """fp32 [splits, slots, out_features]: each slot's row of x (fp16 [slots, in_features],
    rotated, sorted by expert) times its expert's decoded weight, a partial product per split of
    the input (their sum is the product). items: work_items' (experts, first rows); table:
    int64, the address of each expert's int16 trellis [in/16, out/16, 64]; counts and starts:
    int32, where each expert's slots lie in x (both indexed by expert)."""
    in_tiles, out_tiles = in_features // 16, out_features // 16
    if x.dtype != torch.float16 or not x.is_contiguous() or x.shape[1:] != (in_features,):
        raise ValueError(f"x must be contiguous fp16 [slots, {in_features}], not {x.dtype} {tuple(x.shape)}")
    if not len(table) == len(counts) == len(starts):
        raise ValueError(f"table, counts and starts cover {len(table)}, {len(counts)} and {len(starts)} experts")
    if in_features % 16 or out_tiles % nt or in_tiles % splits:
        raise ValueError(f"a {in_features} x {out_features} weight does not divide into {splits} splits "
                         f"and {nt}-tile column blocks")
    slots = x.shape[0]
    out = torch.empty((splits, slots, out_features), dtype=torch.float32, device=x.device)
    experts, first_rows = items
    _expert_tiles_kernel[(out_tiles // nt, len(experts), splits)](
        x, experts, first_rows, table, counts, starts, out, slots, in_tiles, out_tiles, in_tiles // splits,
        M=ITEM_ROWS, NT=nt, DECODE=ASM_VABSDIFF if x.is_cuda else PURE, num_warps=num_warps)
    return out


def hadamard(device) -> torch.Tensor:
    """The 128-point rotation (float32) on `device`, for rotated_in and rotated_out (and the
    signs the MoE layer's kernels rotate by): made once by its holder (a copy to the device,
    which a CUDA graph's capture refuses)."""
    return torch.from_numpy(exl3_format.hadamard()).to(device)


def rotated_in(x: torch.Tensor, suh: torch.Tensor, had: torch.Tensor) -> torch.Tensor:
    """fp16 rows as the product takes them: x times suh (per input, or per row [rows, in]),
    each 128 inputs through the rotation `had`, in fp32 then rounded (as exllamav3's kernels
    hand rotated rows on). In torch: one linear's rows (exl3_gemv.py), and what the MoE
    layer's fused rotations are tested against."""
    rows = x.shape[0]
    return ((x.float() * suh.float()).view(rows, -1, exl3_format.HAD) @ had).view(rows, -1).half()


def rotated_out(y: torch.Tensor, svh: torch.Tensor, had: torch.Tensor) -> torch.Tensor:
    """fp32: the product's output rotated back by `had`, each 128 outputs, times svh (per
    output, or per row [rows, out])."""
    rows = y.shape[0]
    return (y.view(rows, -1, exl3_format.HAD) @ had).view(rows, -1) * svh.float()
