"""Rows to numbers: value = e4m3 x 2^(e8m0 - 127), one E8M0 scale per 32 values."""

from __future__ import annotations

import numpy as np

from .geometry import ROW_BYTES, SCALES_PER_ROW, VALUES_PER_ROW


def _e4m3_table() -> np.ndarray:
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    value[(b & 0x7F) == 0x7F] = np.nan  # E4M3 (fn) has NaN, no infinities
    return (sign * value).astype(np.float32)


E4M3 = _e4m3_table()


def dequantize(rows: np.ndarray) -> np.ndarray:
    """[..., 264] uint8 rows -> [..., 256] float32."""
    rows = np.asarray(rows, np.uint8)
    if rows.shape[-1] != ROW_BYTES:
        raise ValueError(f"rows must end in {ROW_BYTES} bytes, got {rows.shape}")
    values = E4M3[rows[..., :VALUES_PER_ROW]]
    e = rows[..., VALUES_PER_ROW:].astype(np.int32)
    scale = np.where(e == 255, np.nan, np.ldexp(np.float32(1), e - 127)).astype(np.float32)
    group = VALUES_PER_ROW // SCALES_PER_ROW
    return (values.reshape(*values.shape[:-1], SCALES_PER_ROW, group)
            * scale[..., None]).reshape(values.shape)


def dequantize_bf16(rows):
    """The same as a torch bfloat16 tensor (engine side; needs torch)."""
    import torch

    return torch.from_numpy(dequantize(rows)).to(torch.bfloat16)
