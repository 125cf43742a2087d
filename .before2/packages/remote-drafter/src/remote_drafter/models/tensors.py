"""Tensor bytes for content digests (the checkpoints' and EXL3 packs' identities)."""

from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes, any dtype (numpy has no bfloat16: bf16 checkpoints load too)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()  # 0-dim too (EXL3 markers)
