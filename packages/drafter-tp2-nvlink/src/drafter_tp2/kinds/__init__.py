"""What each drafter kind needs to be served by a pair; rank.py runs any of them the same way:

* dspark.py  the Llama-style DSpark drafter: Megatron-style tensor parallel (sharding.py)
* dsv41.py   DeepSeek-V4.1's (and V4's) own drafter, `--drafter dsv41:DIR`: its routed
             experts split over the ranks, each reading only its half of the checkpoint

A kind loads its rank's part on the CPU (its constructor: bad input raises ValueError or
FileNotFoundError, which the pair refuses on both ranks), says what both ranks must agree on
(`hello`: fingerprint, config, and per-tensor digests where a rank reads a slice), checks
what only both ranks' parts together tell (`check`, on both ranks: the same verdict), builds
its shard on the device once both agree (`shard`), gives the round (`rounds`) and what rank 1
receives a round's inputs into (`blank`), and on rank 0 the drafter the one-card Worker
serves (`leader`)."""

from __future__ import annotations


def kind_for(drafter: str):
    """The kind class serving `--drafter` (dsv41:DIR, or a DSpark folder)."""
    if drafter.startswith("dsv41:"):
        from .dsv41 import Dsv41Kind
        return Dsv41Kind
    from .dspark import DSparkKind
    return DSparkKind
