"""A round's host data on its way to the drafter's device. The new rows are joined into a
pinned host buffer kept for the next round (the join is the one host copy) and copied to the
device without blocking the host; from pageable memory the driver would first stage them and
the host would wait. Small arrays (indices, masks, positions) go from pageable memory, which
costs less than the pinned path's own Python, queued (`to_device`), never as torch's
default blocking copy, and a round's together (`to_device_all`). Elsewhere (a CPU device)
the rows are joined and used as they are."""

from __future__ import annotations

import numpy as np
import torch

from remote_drafter.engine.rows import BFLOAT16


def host_tensor(rows: np.ndarray) -> torch.Tensor:
    """Host rows as a tensor of their own type, sharing their memory (bf16: ml_dtypes' bits)."""
    if rows.dtype == BFLOAT16:
        return torch.from_numpy(rows.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(rows)


def to_device(a: np.ndarray, device) -> torch.Tensor:
    """A small host array on `device`, queued behind the device's work: torch's default
    (blocking) copy synchronises the stream, so each one would hold the host until the
    device had run everything queued before it, and a round's host work would stop
    overlapping its kernels. CUDA copies pageable memory into its own staging buffer before
    the call returns, so `a` may change or go at once."""
    return torch.from_numpy(a).to(device, non_blocking=True)


def to_device_all(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """Small int64 host arrays (other integer and bool types are widened) as one queued copy
    (`to_device`): views of one device tensor, shaped as given, so a round makes one such
    call however many arrays it sends."""
    flat = [np.asarray(a).astype(np.int64, copy=False).reshape(-1) for a in arrays]
    joined = to_device(np.concatenate(flat) if flat else np.zeros(0, np.int64), device)
    out, at = [], 0
    for a, f in zip(arrays, flat):
        out.append(joined[at:at + len(f)].view(np.shape(a)))
        at += len(f)
    return out


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == BFLOAT16 else torch.from_numpy(np.empty(0, dtype)).dtype


class RowStage:
    """One pinned buffer for one device, reused: written again only once the last copy out
    of it is done (a buffer outgrown goes back to torch's pinned allocator, which keeps it
    until then). Its size follows the largest round's new rows: at most a window per request
    drafted at once."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buf: torch.Tensor | None = None
        self.copied = torch.cuda.Event() if self.cuda else None  # the last copy out of buf

    def to_device(self, parts: list[np.ndarray]) -> torch.Tensor:
        """parts (one dtype) joined along their first axis, on the device."""
        if not self.cuda:
            return host_tensor(np.concatenate(parts)).to(self.device)
        first = parts[0]
        shape = (sum(len(p) for p in parts), *first.shape[1:])
        nbytes = int(np.prod(shape, dtype=np.int64)) * first.dtype.itemsize
        if self.buf is None or self.buf.numel() < nbytes:
            size = max(nbytes, 2 * (0 if self.buf is None else self.buf.numel()), 1 << 16)
            self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.copied.synchronize()  # at once when nothing was recorded yet
        staged = self.buf[:nbytes]
        np.concatenate(parts, out=staged.numpy().view(first.dtype).reshape(shape))
        out = staged.view(torch_dtype(first.dtype)).view(shape).to(self.device, non_blocking=True)
        self.copied.record(torch.cuda.current_stream(self.device))
        return out
