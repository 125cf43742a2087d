"""An EXL3 linear as exllamav3 stores it, read with numpy alone (no GPU, no exllamav3): the
reference that kernels of our own are checked against, on any machine. Read off exllamav3
1.6.5's format, and pinned to what exllamav3 itself makes of its tensors by
tests/data/exl3-linears.safetensors (benchmarks/exl3_fixture.py, tests/test_exl3_format.py).

The format, for K bits a weight:
* `trellis` int16 [in/16, out/16, 16K]: one 16 x 16 tile of the weight [in, out] per entry.
  A tile's 16K words are its bitstream, read as little-endian pairs of words: uint32s, each
  most significant bit first.
* Weight j of a tile (j < 256, in the tile's stored order) has as its state the 16 bits of
  the stream that end where its own K bits end, at bit (j + 1)K, wrapping to the tile's start
  (tail-biting): its low K bits are its own, the rest its predecessors'.
* The stored order j = 8t + i is the tensor cores' fragment order (TILE_ORDER): lane t holds
  rows (t % 4)·2 + {0, 1, 8, 9} of columns t // 4 and t // 4 + 8.
* A state becomes a weight through a procedural codebook (`decode`): mul1, the one our packs
  and exllamav3's conversions use, or mcg.
* The linear's weight: the decoded [in, out] rotated by a 128-point Hadamard (Sylvester's, over
  √128) on the input side, times `suh` per input, rotated on the output side, times `svh` per
  output, rounded to fp16 after each step (exllamav3's get_weight_tensor)."""

from __future__ import annotations

import numpy as np

HAD = 128
MUL1, MCG = "mul1", "mcg"
MUL1_MULT, MCG_MULT = 0x83DCD12D, 0xCBAC1FED
# mul1's fp16 fma constants, as bit patterns: 0.00676727294921875 and -10.3828125
MUL1_SCALE, MUL1_BIAS = (float(np.uint16(b).view(np.float16)) for b in (0x1EEE, 0xC931))
MCG_MASK, MCG_XOR = 0x8FFF8FFF, 0x3B603B60


def _tile_order() -> np.ndarray:
    """[256, 2]: (row, column) within the tile of each weight, in stored order."""
    order = np.empty((256, 2), np.int64)
    for lane in range(32):
        rows = (lane % 4) * 2 + np.array([0, 1, 8, 9])
        for half, column in enumerate((lane // 4, lane // 4 + 8)):
            order[8 * lane + 4 * half:8 * lane + 4 * half + 4] = np.stack([rows, np.full(4, column)], 1)
    return order


TILE_ORDER = _tile_order()


def states(trellis: np.ndarray, bits: int) -> np.ndarray:
    """uint16 [in/16, out/16, 256]: each weight's trellis state, in stored order."""
    words = np.ascontiguousarray(trellis, "<i2").view("<u4").astype(np.uint64)  # [.., 8K]
    n = words.shape[-1]
    end = (np.arange(256) + 1) * bits + 256 * bits  # + a tile's bits: the window may wrap back
    first, last = (end - 16) // 32 % n, (end - 1) // 32 % n
    shift = (((end - 1) // 32 + 1) * 32 - end).astype(np.uint64)
    window = (words[..., first] << np.uint64(32)) | words[..., last]  # most significant bit first
    return ((window >> shift) & np.uint64(0xFFFF)).astype(np.uint16)


def decode(state: np.ndarray, codebook: str = MUL1) -> np.ndarray:
    """fp16 weights of 16-bit states, each one rounding of its exact value (as the kernels'
    single fp16 fma or add)."""
    if codebook not in (MUL1, MCG):
        raise ValueError(f"codebook {codebook!r}: this reads {MUL1} and {MCG}")
    state = np.asarray(state).astype(np.int64) & 0xFFFF  # int16 states (as stored) are 16 bits, not negative
    x = (state.astype(np.uint64) * (MUL1_MULT if codebook == MUL1 else MCG_MULT)) & 0xFFFFFFFF
    if codebook == MUL1:
        total = sum((x >> np.uint64(8 * b)) & np.uint64(0xFF) for b in range(4)).astype(np.float64)
        return ((1024 + total) * MUL1_SCALE + MUL1_BIAS).astype(np.float16)
    x = ((x & MCG_MASK) ^ MCG_XOR).astype(np.uint32)
    halves = [(x >> np.uint32(shift)).astype(np.uint16).view(np.float16).astype(np.float64) for shift in (0, 16)]
    return (halves[0] + halves[1]).astype(np.float16)


def decoded(trellis: np.ndarray, bits: int, codebook: str = MUL1) -> np.ndarray:
    """fp16 [in, out]: the codebook's weights laid out as the weight, before the rotations
    (exllamav3's reconstruct)."""
    tiles_in, tiles_out = trellis.shape[:2]
    tile = np.empty((tiles_in, tiles_out, 16, 16), np.float16)
    tile[:, :, TILE_ORDER[:, 0], TILE_ORDER[:, 1]] = decode(states(trellis, bits), codebook)
    return tile.transpose(0, 2, 1, 3).reshape(16 * tiles_in, 16 * tiles_out)


def hadamard(n: int = HAD) -> np.ndarray:
    """Sylvester's n-point Hadamard matrix over √n (float32), as exllamav3 builds it for 128."""
    h = np.ones((1, 1), np.float32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(n))


def weight(trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray, bits: int,
           codebook: str = MUL1) -> np.ndarray:
    """fp16 [in, out]: the weight the linear applies (y = x @ weight)."""
    w = decoded(trellis, bits, codebook)
    k, n = w.shape
    had = hadamard()
    w = (had @ w.astype(np.float32).reshape(-1, HAD, n)).reshape(k, n).astype(np.float16)
    w = w * np.asarray(suh, np.float16)[:, None]
    w = (w.astype(np.float32).reshape(k, -1, HAD) @ had).reshape(k, n).astype(np.float16)
    return w * np.asarray(svh, np.float16)[None, :]
