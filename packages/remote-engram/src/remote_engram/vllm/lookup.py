"""The contract of vLLM's `ParallelEngramEmbedding.lookup(indices, out, background)` in torch.

`indices` int [T, H]: one global row id per token and hash head (H = 24 for V4.1). A rank
owns the heads [start, start + count) and, in its table, the rows [lo, hi). Output row
(t, h) is the row of token t's id of head start + h, or zeros when that head is padding
(start + h >= H) or the id lies outside [lo, hi). `out` takes one of two forms:
* packed uint8 [T, count, 264]: the 256 FP8 E4M3 bytes, then the 8 E8M0 scale bytes;
* bfloat16 [T, count, 256]: value x 2^(scale - 127), computed in float32, rounded once.
The local table (the miniature's) and the remote overlay both end in `write_rows`, so the
two paths cannot differ in how `out` is filled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..geometry import SCALES_PER_ROW, VALUES_PER_ROW


@dataclass(frozen=True)
class HeadRange:
    """What one rank reads of one layer's table: heads [start, start + count) of `total`,
    rows [lo, hi)."""

    start: int
    count: int
    total: int
    lo: int
    hi: int

    @classmethod
    def of(cls, table) -> HeadRange:
        """From a table with vLLM's ParallelEngramEmbedding attribute names."""
        return cls(table.head_start, table.part_n_hash_cols, table.n_hash_cols,
                   table.vocab_start_idx, table.vocab_end_idx)

    def owned(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, count] int64, owned [T, count] bool) for `indices` [T, total]."""
        heads = torch.arange(self.start, self.start + self.count, device=indices.device)
        ids = indices[:, heads.clamp(max=self.total - 1)].long()
        owned = (heads < self.total) & (ids >= self.lo) & (ids < self.hi)
        return ids, owned


def table_rows(weight: torch.Tensor, scales: torch.Tensor, heads: HeadRange,
               ids: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """Rows uint8 [T, count, 264] from a table held in memory: `weight` FP8 [hi - lo, 256],
    `scales` uint8 [hi - lo, 8]; zeros where not owned."""
    local = torch.where(owned, ids - heads.lo, 0)
    rows = torch.cat([weight[local].view(torch.uint8), scales[local]], dim=-1)
    return rows * owned[..., None]


def write_rows(rows: torch.Tensor, out: torch.Tensor) -> None:
    """Rows uint8 [T, count, 264] into `out`, packed or dequantised (module docstring)."""
    rows = rows.to(out.device)
    if out.dtype == torch.uint8:
        out.copy_(rows.reshape(out.shape))
        return
    values = rows[..., :VALUES_PER_ROW].contiguous().view(torch.float8_e4m3fn).float()
    # An E8M0 byte is exactly an fp32 exponent field: shift it into place (as the kernel does).
    scales = (rows[..., VALUES_PER_ROW:].int() << 23).view(torch.float32)
    group = VALUES_PER_ROW // SCALES_PER_ROW
    grouped = values.reshape(*values.shape[:-1], SCALES_PER_ROW, group) * scales[..., None]
    out.copy_(grouped.reshape(out.shape).to(out.dtype))
