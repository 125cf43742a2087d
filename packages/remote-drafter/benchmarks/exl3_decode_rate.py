"""How fast can a kernel turn EXL3 4-bit trellis bytes into fp16 weights and use them, on this
GPU, against reading the same bytes? Kernels of our own (Triton; no exllamav3) decode with
exllamav3's codebooks, so that exllamav3's expert kernels can be set against what the format
allows here.

Timed over one trellis buffer of `--mib` MiB (random words), each kernel persistent (a few
programs per SM looping over chunks of tiles, a warp a tile, a lane a word), chunk sizes, warps
and programs tried, the best kept:

- read: the buffer's words summed (the bandwidth reference, vectorised loads); read+next: also
  each word's next in its tile, with the decode's scalar loads (the next from L1);
- mul1 and mcg: a GEMV-like pass, y = sum of w * a over every weight, w decoded from its
  trellis state, a an fp16 activation per weight position in the tile (256 of them, kept in
  registers), products accumulated in fp32, one partial per program. Decodes: `pure` (Triton
  ops only, also what the CPU interpreter runs) and, on CUDA, inline PTX: `dp4a` or
  `vabsdiff4` for mul1's byte sum then one fp16 fma, `lop3` then one fp16 add for mcg;
- .../xor: the same decode with the weights' fp16 bits XORed instead of the GEMV (one LOP3 a
  weight, not a conversion and an FFMA): the decode's own rate, near what a consumer that costs
  the ALUs nothing (tensor-core MMA on packed fp16) would see.

Per variant: GB/s of trellis bytes, G weights/s, the ratio to the read rate, and (CUDA) the
registers and the SASS instructions per weight of the kernel's main loop by opcode (what bounds
a decode that the memory does not is its instructions and the pipes they issue to). Each decode is first
checked on the device against the numpy reference below, its weights bit for bit. Prints a
table; writes JSON (`--out`).

    python packages/remote-drafter/benchmarks/exl3_decode_rate.py --out x.json
    TRITON_INTERPRET=1 python packages/remote-drafter/benchmarks/exl3_decode_rate.py --device cpu --mib 1

Trellis layout (ours: least significant bit first and each state reaching forward, where
exllamav3's stream is most significant bit first with each state reaching back, and its tiles
are in the tensor cores' order, models/exl3_format.py; either asks the same instructions a
weight): 4 bits per weight; a tile is 256 weights in 32 uint32 words, bit i of its 1024-bit
stream being bit i % 32 of word i // 32; weight j's 16-bit state is bits [4j, 4j + 16) of the
stream, wrapping to the tile's start (tail-biting). So word p and word (p + 1) % 32 of a tile
hold the states of weights 8p .. 8p + 7, at shifts 0, 4, .., 28 of their 64-bit window.

Codebooks (exllamav3's procedural ones), s a state:
- mul1: x = s * 0x83DCD12D mod 2**32; w = fp16 fma(fp16(1024 + byte sum of x), 0x1EEE, 0xC931)
  (fp16 bit patterns: 0.00676727294921875, -10.3828125); 0x6400 + sum read as fp16 is 1024 + sum.
- mcg: x = s * 0xCBAC1FED mod 2**32; x = (x & 0x8FFF8FFF) ^ 0x3B603B60; w = fp16(x_lo) + fp16(x_hi).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import re
import statistics
import time
from collections import Counter

import numpy as np
import torch

if not torch.cuda.is_available():  # before Triton defines a kernel: it picks interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from remote_drafter.models import exl3_format  # noqa: E402
from remote_drafter.models.exl3_triton import ASM, ASM_VABSDIFF, MCG, MUL1, PURE, tile_offsets  # noqa: E402
from remote_drafter.models.exl3_triton import decode as _decode  # noqa: E402

TILE_WORDS, TILE_WEIGHTS = 32, 256
CODEBOOKS = {MUL1: exl3_format.MUL1, MCG: exl3_format.MCG}  # the kernels' CB -> the reference's
GEMV, XOR = 0, 1  # what is done with the weights: the fp32 GEMV, or their bits XORed (decode only)
READ_VARIANTS = [("read", 0), ("read+next", 1)]  # (name, with each word's next)
# (name, codebook, decode, use); the inline-PTX ones need CUDA
DECODE_VARIANTS = [("mul1/pure", MUL1, PURE, GEMV), ("mul1/dp4a", MUL1, ASM, GEMV),
                   ("mul1/vabsdiff4", MUL1, ASM_VABSDIFF, GEMV), ("mcg/pure", MCG, PURE, GEMV),
                   ("mcg/lop3", MCG, ASM, GEMV), ("mul1/vabsdiff4/xor", MUL1, ASM_VABSDIFF, XOR),
                   ("mcg/lop3/xor", MCG, ASM, XOR)]
# (tiles a chunk, warps, programs per SM): the search the GPU run makes
CUDA_CONFIGS = list(itertools.product((32, 64, 128), (4, 8), (4, 8)))
CPU_CONFIG = (1024, 1, 2)  # the interpreter: one config, large arrays (its cost is per op)
CHECK_TILES = 64


# ---- numpy reference, straight from the definitions above --------------------------------------

def tile_states(words: np.ndarray) -> np.ndarray:
    """[n * 32] uint32 words -> [n * 256] uint32 states, from each tile's bitstream."""
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little").reshape(-1, 1024)
    at = (4 * np.arange(TILE_WEIGHTS)[:, None] + np.arange(16)[None, :]) % 1024  # tail-biting
    return (bits[:, at].astype(np.uint32) << np.arange(16, dtype=np.uint32)).sum(-1, dtype=np.uint32).reshape(-1)


def decode(states: np.ndarray, codebook: int) -> np.ndarray:
    """fp16 weights of 16-bit states: exllamav3's codebooks as models/exl3_format reads them."""
    return exl3_format.decode(states, CODEBOOKS[codebook])


def gemv(words: np.ndarray, act: np.ndarray, codebook: int) -> float:
    """sum of w * a over the buffer (float64; every product of two fp16 is exact)."""
    w = decode(tile_states(words), codebook).astype(np.float64).reshape(-1, TILE_WEIGHTS)
    return float((w * act.astype(np.float64)[None, :]).sum())


def xor(words: np.ndarray, codebook: int) -> int:
    """The XOR of the buffer's weights' fp16 bit patterns."""
    return int(np.bitwise_xor.reduce(decode(tile_states(words), codebook).view(np.uint16)))


# ---- Triton ------------------------------------------------------------------------------------

@triton.jit
def _state(lo, hi, K: tl.constexpr):
    """Bits [4K, 4K + 16) of the window hi:lo (K static: no shift by 32 or more is built), as
    16-bit fields at byte offsets of lo or of the window shifted by 4 (one funnel shift a word,
    shared by the odd K), which compile to one byte permute (PRMT) or shift each."""
    if K % 2 == 0:
        w, x = lo, hi
    else:
        w, x = (lo >> 4) | (hi << 28), hi >> 4
    if K < 6:
        s = (w >> (8 * (K // 2))) & 0xFFFF
    else:
        s = ((w >> 24) | (x << 8)) & 0xFFFF
    return s


@triton.jit
def _term(acc, lo, hi, a, K: tl.constexpr, CB: tl.constexpr, DECODE: tl.constexpr, USE: tl.constexpr):
    """acc with weight K of each word (of the window hi:lo) used: w * a added, or its bits XORed."""
    w = _decode(_state(lo, hi, K), CB, DECODE)
    if USE == 0:
        acc = acc + w.to(tl.float32) * a
    else:
        acc = acc ^ w.to(tl.uint16, bitcast=True)  # 16 bits wide: no zero extension
    return acc


@triton.jit
def _gemv_kernel(words_ptr, act_ptr, out_ptr, n_chunks, CB: tl.constexpr, DECODE: tl.constexpr,
                 USE: tl.constexpr, TILES: tl.constexpr):
    """out[program] = its chunks' sum of w * act[position in tile] (USE 0, fp32) or XOR of the
    w's fp16 bits (USE 1, int32); a chunk is TILES tiles."""
    here, there = tile_offsets(TILES, 1)
    cols = tl.arange(0, 32)[None, :]
    # weight 8p + k of every tile meets act[8p + k]: loaded once, kept in registers
    a0 = tl.load(act_ptr + cols * 8 + 0).to(tl.float32)
    a1 = tl.load(act_ptr + cols * 8 + 1).to(tl.float32)
    a2 = tl.load(act_ptr + cols * 8 + 2).to(tl.float32)
    a3 = tl.load(act_ptr + cols * 8 + 3).to(tl.float32)
    a4 = tl.load(act_ptr + cols * 8 + 4).to(tl.float32)
    a5 = tl.load(act_ptr + cols * 8 + 5).to(tl.float32)
    a6 = tl.load(act_ptr + cols * 8 + 6).to(tl.float32)
    a7 = tl.load(act_ptr + cols * 8 + 7).to(tl.float32)
    acc = tl.zeros([TILES, 32], tl.float32 if USE == 0 else tl.uint16)
    for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
        base = words_ptr + c * (TILES * 32)
        lo = tl.load(base + here).to(tl.uint32, bitcast=True)
        hi = tl.load(base + there).to(tl.uint32, bitcast=True)  # the next word of the tile: L1
        acc = _term(acc, lo, hi, a0, 0, CB, DECODE, USE)
        acc = _term(acc, lo, hi, a1, 1, CB, DECODE, USE)
        acc = _term(acc, lo, hi, a2, 2, CB, DECODE, USE)
        acc = _term(acc, lo, hi, a3, 3, CB, DECODE, USE)
        acc = _term(acc, lo, hi, a4, 4, CB, DECODE, USE)
        acc = _term(acc, lo, hi, a5, 5, CB, DECODE, USE)
        acc = _term(acc, lo, hi, a6, 6, CB, DECODE, USE)
        acc = _term(acc, lo, hi, a7, 7, CB, DECODE, USE)
    if USE == 0:
        tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))
    else:
        tl.store(out_ptr + tl.program_id(0), tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0).to(tl.int32))


@triton.jit
def _read_kernel(words_ptr, out_ptr, n_chunks, NEXT: tl.constexpr, TILES: tl.constexpr):
    """out[program] = its chunks' words summed mod 2**32 (with NEXT, each word's neighbour too)."""
    here, there = tile_offsets(TILES, 1)
    words = tl.arange(0, TILES)[:, None] * 32 + tl.arange(0, 32)[None, :]
    acc = tl.zeros([TILES, 32], tl.uint32)
    for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
        base = words_ptr + c * (TILES * 32)
        if NEXT:  # as the decode loads them
            acc += tl.load(base + here).to(tl.uint32, bitcast=True) + tl.load(base + there).to(tl.uint32, bitcast=True)
        else:  # vectorised: the plain read
            acc += tl.load(base + words).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _decode_tiles_kernel(words_ptr, out_ptr, CB: tl.constexpr, DECODE: tl.constexpr, TILES: tl.constexpr):
    """out[tile * 256 + j] = weight j of the tile (fp16): the exact test's path."""
    tiles = tl.program_id(0) * TILES + tl.arange(0, TILES)[:, None]
    cols = tl.arange(0, 32)[None, :]
    lo = tl.load(words_ptr + tiles * 32 + cols).to(tl.uint32, bitcast=True)
    hi = tl.load(words_ptr + tiles * 32 + (cols + 1) % 32).to(tl.uint32, bitcast=True)
    for k in tl.static_range(8):
        tl.store(out_ptr + tiles * 256 + cols * 8 + k, _decode(_state(lo, hi, k), CB, DECODE))


# ---- launchers ---------------------------------------------------------------------------------

def _chunks(words: torch.Tensor, tiles: int) -> int:
    assert words.dtype == torch.int32 and words.numel() < 2**31 and words.numel() % (tiles * 32) == 0
    return words.numel() // (tiles * 32)


def run_gemv(words, act, codebook, decode_with, use, tiles, num_warps, programs):
    """Partials ([programs]) of the GEMV over int32 trellis words and 256 fp16 act (fp32), or
    with use=XOR of the XOR of the weights' bits (int32)."""
    out = torch.empty(programs, dtype=torch.float32 if use == GEMV else torch.int32, device=words.device)
    kernel = _gemv_kernel[(programs,)](words, act, out, _chunks(words, tiles), CB=codebook, DECODE=decode_with,
                                       USE=use, TILES=tiles, num_warps=num_warps)
    return out, kernel


def run_read(words, with_next, tiles, num_warps, programs):
    """Partial word sums (int32 [programs], mod 2**32)."""
    out = torch.empty(programs, dtype=torch.int32, device=words.device)
    kernel = _read_kernel[(programs,)](words, out, _chunks(words, tiles), NEXT=with_next,
                                       TILES=tiles, num_warps=num_warps)
    return out, kernel


def decode_tiles(words: torch.Tensor, codebook: int, decode_with: int = PURE, tiles: int = 4) -> torch.Tensor:
    """The fp16 weights of int32 trellis words (a multiple of `tiles` tiles)."""
    out = torch.empty(words.numel() * 8, dtype=torch.float16, device=words.device)
    _decode_tiles_kernel[(_chunks(words, tiles),)](words, out, CB=codebook, DECODE=decode_with,
                                                    TILES=tiles, num_warps=1)
    return out


# ---- the benchmark -----------------------------------------------------------------------------

def loop_sass(kernel, weights_per_thread: float) -> dict | None:
    """SASS instructions of the kernel's main loop (its longest backward branch's span), per
    weight a thread decodes in one trip, and their count by opcode."""
    try:
        lines = kernel.asm["sass"].splitlines()  # Triton's listing: "ctrl<TAB>INSTR;", "LBBn:"
    except Exception:  # no disassembler: the figure is left out, not the run
        return None
    ops, labels, loops = [], {}, []
    for line in lines:
        if re.fullmatch(r"LBB\d+:", line.strip()):
            labels[line.strip()[:-1]] = len(ops)
        elif "\t" in line:
            instr = re.sub(r"^@!?U?P\w+\s+", "", line.split("\t", 1)[1].strip())
            target = re.search(r"BRA.*\b(LBB\d+);", instr)
            if target and target[1] in labels:
                loops.append((labels[target[1]], len(ops)))
            ops.append(instr.split()[0].rstrip(";").split(".")[0])
    if not loops:
        return None
    start, end = max(loops, key=lambda span: span[1] - span[0])
    count = Counter(ops[start:end + 1])
    n = end + 1 - start
    return {"instructions": n, "per_weight": round(n / weights_per_thread, 2), "by_op": dict(count.most_common())}


def timed(fn, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after `warmup`. On CUDA each timed call is
    queued behind an untimed one, so that its launch's host cost stays out of the figure."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(device: str, codebook: int, decode_with: int, use: int) -> dict:
    """The decode on the device against the numpy reference: its weights bit for bit, then the
    kernel timed: the GEMV within fp32 summation error, or the XOR exact."""
    rng = np.random.default_rng(codebook * 3 + decode_with)
    words = rng.integers(0, 2**32, CHECK_TILES * TILE_WORDS, dtype=np.uint32)
    act = rng.standard_normal(TILE_WEIGHTS).astype(np.float16)
    w = torch.from_numpy(words.view(np.int32)).to(device)
    got = decode_tiles(w, codebook, decode_with).cpu().numpy()
    want = decode(tile_states(words), codebook)
    result = {"weights_exact": bool(np.array_equal(got.view(np.uint16), want.view(np.uint16)))}
    partials = run_gemv(w, torch.from_numpy(act).to(device), codebook, decode_with, use, 16, 4, 3)[0].cpu()
    if use == GEMV:
        scale = np.abs(want.astype(np.float64).reshape(-1, TILE_WEIGHTS) * act.astype(np.float64)).sum()
        result["gemv_error"] = abs(float(partials.double().sum()) - gemv(words, act, codebook)) / float(scale)
    else:
        result["xor_exact"] = int(np.bitwise_xor.reduce(partials.numpy().view(np.uint32))) == xor(words, codebook)
    return result


def fastest(call, configs, sms: int, device: str, repeats: int) -> dict:
    """call(tiles, num_warps, programs) timed at each config: the best's figures and all trials."""
    trials = []
    for tiles, num_warps, per_sm in configs:
        run = functools.partial(call, tiles, num_warps, sms * per_sm)
        kernel = run()[1]  # compiles
        trials.append({"tiles": tiles, "num_warps": num_warps, "programs": sms * per_sm, "kernel": kernel,
                       "ms": timed(run, device, warmup=2 if device == "cuda" else 0, repeats=repeats) * 1e3})
    best = min(trials, key=lambda t: t["ms"])
    row = {"best": {k: best[k] for k in ("tiles", "num_warps", "programs", "ms")},
           "trials": [{k: v for k, v in t.items() if k != "kernel"} for t in trials]}
    if device == "cuda":
        row["registers"] = best["kernel"].n_regs
        row["loop_sass"] = loop_sass(best["kernel"], best["tiles"] * 8 / best["num_warps"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (the measurement) or cpu: Triton's interpreter, a smoke run "
                             "(TRITON_INTERPRET=1, one config, pure decodes only)")
    parser.add_argument("--mib", type=float, default=1536, help="trellis buffer size in MiB (default 1536)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per config after warm-up, the median kept (default 10 on cuda, 2 on cpu)")
    parser.add_argument("--out", default="exl3-decode-rate.json", help="JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if (args.device == "cpu") != interpreted:
        parser.error("--device cpu runs under TRITON_INTERPRET=1 and cuda without it")
    cuda = args.device == "cuda"
    repeats = args.repeats or (10 if cuda else 2)
    configs = CUDA_CONFIGS if cuda else [CPU_CONFIG]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 1
    unit = max(t for t, _, _ in configs) * TILE_WORDS * 4  # bytes: every config's chunks divide it
    nbytes = max(unit, int(args.mib * 2**20) // unit * unit)
    n_words = nbytes // 4
    gen = torch.Generator(device=args.device).manual_seed(0)
    words = torch.randint(-2**31, 2**31, (n_words,), dtype=torch.int32, device=args.device, generator=gen)
    act = torch.randn(TILE_WEIGHTS, generator=gen, device=args.device).to(torch.float16)

    rows = []
    for name, with_next in READ_VARIANTS:
        rows.append({"variant": name} | fastest(functools.partial(run_read, words, with_next),
                                                 configs, sms, args.device, repeats))
    for name, codebook, decode_with, use in DECODE_VARIANTS:
        if decode_with != PURE and not cuda:
            continue  # inline PTX: CUDA only
        row = {"variant": name} | check(args.device, codebook, decode_with, use)
        row |= fastest(functools.partial(run_gemv, words, act, codebook, decode_with, use),
                       configs, sms, args.device, repeats)
        rows.append(row)
    for row in rows:
        seconds = row["best"]["ms"] / 1e3
        row.update(gb_s=nbytes / seconds / 1e9, gweights_s=2 * nbytes / seconds / 1e9)
    read_rate = rows[0]["gb_s"]
    for row in rows:
        row["vs_read"] = row["gb_s"] / read_rate

    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "buffer_bytes": nbytes,
              "repeats": repeats, "variants": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['device']}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{nbytes / 2**30:.3f} GiB of trellis ({2 * nbytes / 1e9:.2f} G weights)")
    print(f"{'variant':<20}{'GB/s':>9}{'Gw/s':>9}{'vs read':>9}{'ms':>9}  {'tiles/warps/progs':<18}"
          f"{'SASS/w':>7}  check")
    for row in rows:
        b, sass = row["best"], row.get("loop_sass") or {}
        config = f"{b['tiles']}/{b['num_warps']}/{b['programs']}"
        check_ = "" if "weights_exact" not in row else (
            ("weights exact" if row["weights_exact"] else "WEIGHTS DIFFER") + ", "
            + (f"GEMV rel. error {row['gemv_error']:.1e}" if "gemv_error" in row
               else "XOR exact" if row["xor_exact"] else "XOR DIFFERS"))
        print(f"{row['variant']:<20}{row['gb_s']:>9.4g}{row['gweights_s']:>9.4g}{row['vs_read']:>9.3f}"
              f"{b['ms']:>9.3g}  {config:<18}{sass.get('per_weight', ''):>7}  {check_}")
    print(f"wrote {args.out}")
    checked = [r for r in rows if "weights_exact" in r]
    return 0 if all(r["weights_exact"] and r.get("xor_exact", True) and r.get("gemv_error", 0) <= 1e-5
                    for r in checked) else 1


if __name__ == "__main__":
    raise SystemExit(main())
