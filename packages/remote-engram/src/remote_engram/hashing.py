"""Engram row ids for a batch of token sequences (numpy; vllm/hashing.py mirrors it in torch).

For position t and offset d, s_d = map[token(t - d)]. A position before the sequence start
or masked out is dead; once a dead position is crossed, s_d = map[pad] for that and every
longer offset. mix = s_0 m_0, then for n = 2..N: mix ^= s_{n-1} m_{n-1}, and the row of
head h of order n is mix mod P(n, h) + offset(n, h).
"""

from __future__ import annotations

import numpy as np

from .geometry import EngramGeometry

PAD_TOKEN_ID = 2


def shift(a: np.ndarray, d: int, fill) -> np.ndarray:
    """a moved d positions later along the sequence axis; the first d positions get fill."""
    out = np.full_like(a, fill)
    if d < a.shape[1]:
        out[:, d:] = a[:, :a.shape[1] - d]
    return out


def shifted_ids(compressed: np.ndarray, valid: np.ndarray, pad: int, max_order: int) -> list:
    """[s_0, .., s_{N-1}], each [B, T]: compressed ids d positions back, pad once dead."""
    alive = valid.copy()
    out = []
    for d in range(max_order):
        alive &= shift(valid, d, False)  # dead once any position 0..d back is dead or absent
        out.append(np.where(alive, shift(compressed, d, pad), pad))
    return out


def row_ids(geometry: EngramGeometry, layer: int, tokens: np.ndarray, token_map: np.ndarray,
            valid: np.ndarray | None = None, pad_token: int = PAD_TOKEN_ID,
            columns: tuple[int, int] | None = None) -> np.ndarray:
    """Row ids [B, T, C] (int64) of `layer` for raw token ids `tokens` [B, T].

    `valid` [B, T] marks live positions (default: all). `columns` = (c0, c1) keeps only
    those (order, head) columns, e.g. geometry.rank_columns(rank, 2).
    """
    tokens = np.atleast_2d(np.asarray(tokens, dtype=np.int64))
    valid = np.ones(tokens.shape, bool) if valid is None else np.atleast_2d(np.asarray(valid, bool))
    token_map = np.asarray(token_map, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= len(token_map)):
        raise ValueError(f"token ids must lie in [0, {len(token_map)})")
    compressed = token_map[tokens]
    s = shifted_ids(compressed, valid, int(token_map[pad_token]), geometry.max_order)
    m = geometry.mults[layer]
    primes, offsets = geometry.primes[layer], geometry.offsets[layer]
    c0, c1 = columns or (0, geometry.columns)
    out = np.empty(tokens.shape + (c1 - c0,), np.int64)
    mix = s[0] * m[0]
    for i, n in enumerate(geometry.orders):
        mix = mix ^ (s[n - 1] * m[n - 1])
        for h in range(geometry.heads):
            col = i * geometry.heads + h
            if c0 <= col < c1:
                out[..., col - c0] = mix % primes[col] + offsets[col]
    return out
