"""Round-cost model: what an expected accepted length buys at a given batch size.

A round at batch B and depth k costs
    verify(B, k) + draft(k) + overhead,   verify = v0 + v1 * B * (k + 1),  draft = d0 + d1 * k
(draft = 0 at k = 0: target-only decoding) and yields B * (1 + E_k) tokens. Inputs come
from measurements (longctx-bench step times, the drafter worker's bench).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RoundCost:
    verify_base_ms: float
    verify_per_row_ms: float
    draft_base_ms: float
    draft_per_token_ms: float
    overhead_ms: float = 0.0

    @classmethod
    def parse(cls, text: str) -> RoundCost:
        """'v0,v1,d0,d1,overhead' in ms; ValueError naming what is wrong."""
        parts = text.split(",")
        try:
            values = [float(x) for x in parts]
        except ValueError:
            values = []
        if len(values) != 5 or any(v < 0 for v in values):
            raise ValueError(f"--cost {text!r}: five numbers >= 0 in ms, verify_base,verify_per_row,"
                             "draft_base,draft_per_token,overhead (e.g. 5,0.2,1,0.3,0.5)")
        return cls(*values)

    def round_ms(self, batch: int, k: int) -> float:
        verify = self.verify_base_ms + self.verify_per_row_ms * batch * (k + 1)
        draft = self.draft_base_ms + self.draft_per_token_ms * k if k else 0.0
        return verify + draft + self.overhead_ms

    def tokens_per_s(self, batch: int, k: int, expected_accepted: float) -> float:
        return batch * (1 + expected_accepted) / self.round_ms(batch, k) * 1000


def depth_table(cost: RoundCost, expected: dict[int, float], batches: list[int]) -> dict:
    """Best k per batch size (k = 0 means target-only) with the predicted speedup."""
    table = {}
    for b in batches:
        base = cost.tokens_per_s(b, 0, 0.0)
        rates = {k: cost.tokens_per_s(b, k, e) for k, e in expected.items()}
        rates[0] = base
        best = max(rates, key=rates.get)
        table[b] = {"k": best, "tokens_per_s": rates[best], "speedup": rates[best] / base,
                    "per_k": {str(k): r / base for k, r in sorted(rates.items())}}
    return {"cost": asdict(cost), "batches": table}
