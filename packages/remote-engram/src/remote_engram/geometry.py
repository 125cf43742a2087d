"""Engram table geometry: primes, row offsets and hash multipliers per layer
(ARCHITECTURE.md § Engram geometry).

For each layer in order, for each n-gram order, for each head: the next prime above the
previous one (starting above prime_start - 1, afresh per layer), never reusing a prime any
layer already took. A head's row offset is the exclusive cumulative sum of the primes in
(order, head) order; a layer's table has the sum of its primes as rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INT64_MAX = np.iinfo(np.int64).max
ROW_BYTES = 264  # 256 FP8 E4M3 values + 8 E8M0 scales (one per 32 values)
VALUES_PER_ROW = 256
SCALES_PER_ROW = 8


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (these bases suffice)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def multipliers(layer: int, vocab: int, max_order: int) -> np.ndarray:
    """Odd hash multipliers m_0..m_{N-1}; each < INT64_MAX / vocab, so s * m never overflows."""
    rng = np.random.default_rng(10007 * layer)
    return 2 * rng.integers(0, (INT64_MAX // vocab) // 2, max_order, dtype=np.int64) + 1


@dataclass(frozen=True)
class EngramGeometry:
    """Everything about the tables that follows from (layers, vocab, orders, heads)."""

    layers: tuple[int, ...]
    vocab: int  # compressed vocabulary size Vc
    orders: tuple[int, ...] = (2, 3, 4)
    heads: int = 8
    prime_start: int = 16_000_000
    primes: dict = field(init=False, repr=False, compare=False)
    offsets: dict = field(init=False, repr=False, compare=False)
    mults: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if list(self.orders) != list(range(2, 2 + len(self.orders))):
            raise ValueError(f"orders must run 2, 3, ... without gaps, got {self.orders}")
        used: set[int] = set()
        primes, offsets, mults = {}, {}, {}
        for layer in self.layers:
            p, ps = self.prime_start - 1, []
            for _ in range(self.columns):
                p += 1
                while p in used or not is_prime(p):
                    p += 1
                used.add(p)
                ps.append(p)
            primes[layer] = np.array(ps, dtype=np.int64)
            offsets[layer] = np.concatenate([[0], np.cumsum(ps)[:-1]]).astype(np.int64)
            mults[layer] = multipliers(layer, self.vocab, self.max_order)
        object.__setattr__(self, "primes", primes)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "mults", mults)

    @property
    def max_order(self) -> int:
        return max(self.orders)

    @property
    def columns(self) -> int:
        """Row ids per token per layer: one per (order, head)."""
        return len(self.orders) * self.heads

    def rows(self, layer: int) -> int:
        return int(self.primes[layer].sum())

    def rank_columns(self, rank: int, nranks: int) -> tuple[int, int]:
        """The contiguous (order, head) columns [c0, c1) rank `rank` of `nranks` owns."""
        if self.columns % nranks:
            raise ValueError(f"{self.columns} columns do not split over {nranks} ranks")
        per = self.columns // nranks
        return rank * per, (rank + 1) * per

    def rank_rows(self, layer: int, rank: int, nranks: int) -> tuple[int, int]:
        """The global row range [lo, hi) of that rank's shard."""
        c0, c1 = self.rank_columns(rank, nranks)
        off, ps = self.offsets[layer], self.primes[layer]
        return int(off[c0]), int(off[c1 - 1] + ps[c1 - 1])

    def describe(self) -> dict:
        return {
            "vocab": self.vocab, "orders": list(self.orders), "heads": self.heads,
            "row_bytes": ROW_BYTES,
            "layers": {str(layer): {
                "rows": self.rows(layer),
                "bytes": self.rows(layer) * ROW_BYTES,
                "primes": self.primes[layer].tolist(),
                "offsets": self.offsets[layer].tolist(),
                "multipliers": self.mults[layer].tolist(),
            } for layer in self.layers},
        }


V41_VOCAB = 99_092
V41 = EngramGeometry(layers=(1, 14), vocab=V41_VOCAB)
"""DeepSeek-V4.1-Flash: layers 1 and 14, 99,092 compressed ids, orders 2-4, 8 heads."""
