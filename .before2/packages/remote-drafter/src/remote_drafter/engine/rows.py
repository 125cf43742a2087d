"""The target's hidden rows on the host, in the type they travel in. A bf16 model's rows stay
bf16 from the engine's GPU to the drafter's: copied to the host as they are, sent as they
are, kept in the histories as they are, and cast (if at all) on the drafter's device, so no
side converts a row on its CPU. Torch-free: numpy arrays, bf16 as ml_dtypes' bfloat16."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
_EXPONENT = {np.dtype(np.float16): 0x7C00, BFLOAT16: 0x7F80}  # all ones: infinity or NaN


def dtype_of(name: str | None) -> np.dtype:
    """The host dtype of rows for a model computing in `name` ("bfloat16", "float16",
    "float32"; anything else, e.g. "none": float32)."""
    return DTYPES.get(name or "", DTYPES["float32"])


def as_rows(hidden) -> np.ndarray | None:
    """numpy or a tensor (any device) -> [n, feature] on the host. bf16, f16 and f32 keep
    their type (a bf16 tensor's bits are viewed, not converted); other types become float32."""
    if hidden is None:
        return None
    if hasattr(hidden, "detach"):  # a torch tensor, without importing torch
        hidden = _host_array(hidden.detach())
    rows = np.asarray(hidden)
    if rows.dtype not in DTYPES.values():
        rows = rows.astype(np.float32)
    return rows.reshape(len(rows), -1) if rows.ndim != 2 else rows


def _host_array(tensor) -> np.ndarray:
    name = str(tensor.dtype).removeprefix("torch.")
    if name == "bfloat16":  # numpy has no bf16: its bits through int16, then ml_dtypes' view
        torch = sys.modules["torch"]  # loaded, as a tensor exists: this room never imports it
        return tensor.cpu().view(torch.int16).numpy().view(BFLOAT16)
    return tensor.cpu().numpy() if name in DTYPES else tensor.float().cpu().numpy()


def cast(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """rows as `dtype` (themselves when they are already). float32 -> bf16 rounds to nearest
    even on the bits, as torch does (faster than ml_dtypes' element loop)."""
    if rows.dtype == dtype:
        return rows
    if dtype == BFLOAT16 and rows.dtype == np.float32:
        bits = np.ascontiguousarray(rows).view(np.uint32)
        rounded = (bits >> 16) & 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        return rounded.astype(np.uint16).view(BFLOAT16)
    if rows.dtype == BFLOAT16 and dtype == np.float32:
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return rows.astype(dtype)


def all_finite(rows: np.ndarray) -> bool:
    """No NaN or infinity among the rows (half types tested on their exponent bits)."""
    exponent = _EXPONENT.get(rows.dtype)
    if exponent is None:
        return bool(np.isfinite(rows).all())
    if not rows.size:
        return True
    # A half is infinite or NaN from its exponent's all-ones pattern up: as a positive, the
    # largest values read as int16, as a negative, the largest read as uint16 (two maxima,
    # no masked copy of the rows).
    bits = rows.view(np.uint16)
    return int(bits.view(np.int16).max()) < exponent and int(bits.max()) < (0x8000 | exponent)
