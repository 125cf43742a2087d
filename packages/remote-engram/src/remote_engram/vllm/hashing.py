"""Engram row ids in torch (engine side, on the device the tokens live on); equal to
remote_engram.hashing.row_ids, the reference (tests compare them on random inputs)."""

from __future__ import annotations

import torch

from ..geometry import EngramGeometry
from ..hashing import PAD_TOKEN_ID


def row_ids(geometry: EngramGeometry, layer: int, tokens: torch.Tensor, token_map: torch.Tensor,
            valid: torch.Tensor | None = None, pad_token: int = PAD_TOKEN_ID,
            columns: tuple[int, int] | None = None) -> torch.Tensor:
    tokens = torch.atleast_2d(tokens).long()
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else torch.atleast_2d(valid)
    token_map = token_map.to(tokens.device).long()
    compressed = token_map[tokens]
    pad = token_map[pad_token]
    length = tokens.shape[1]
    alive = valid.clone()
    s = []
    for d in range(geometry.max_order):
        ids = torch.full_like(compressed, int(pad))
        back = torch.zeros_like(valid)
        if d < length:
            ids[:, d:] = compressed[:, :length - d]
            back[:, d:] = valid[:, :length - d]
        if d:
            alive = alive & back
        s.append(torch.where(alive, ids, pad))
    return mix(geometry, layer, s, columns)


def mix(geometry: EngramGeometry, layer: int, s: list[torch.Tensor],
        columns: tuple[int, int] | None = None) -> torch.Tensor:
    """Row ids [..., C] from s = [s_0, .., s_{N-1}]: the compressed ids 0..N-1 positions back
    (pad where dead), each of any shape [...]. Callers that keep their own history (the vLLM
    miniature's slot cache) build s themselves."""
    dev = s[0].device
    m = torch.as_tensor(geometry.mults[layer], device=dev)
    primes = torch.as_tensor(geometry.primes[layer], device=dev)
    offsets = torch.as_tensor(geometry.offsets[layer], device=dev)
    c0, c1 = columns or (0, geometry.columns)
    cols = []
    mixed = s[0] * m[0]
    for n in geometry.orders:
        mixed = torch.bitwise_xor(mixed, s[n - 1] * m[n - 1])
        cols.append(mixed.unsqueeze(-1).expand(*mixed.shape, geometry.heads))
    mixes = torch.cat(cols, dim=-1)[..., c0:c1]
    return torch.remainder(mixes, primes[c0:c1]) + offsets[c0:c1]
