"""Megatron-style sharding of a loaded DSpark drafter over two ranks, and the pieces the
DeepSeek drafter's expert-parallel split shares with it (bounds, Reducer, VocabParallel).

Per layer: q/k/v column-parallel by whole key/value-head groups (rank 0 takes the first
ceil(kv/2) kv heads and their query heads), o row-parallel; gate/up column-parallel, down
row-parallel; one all-reduce after o and one after down, so the residual stream is the same
on both ranks after every sublayer (a two-way sum a + b is commutative, hence bit-identical
on both). The embedding and output head (the target's, tied or not) are vocab-parallel:
each rank holds half the rows; a lookup is summed over ranks (the other rank adds exact
zeros) and the head's logits are gathered along the vocabulary. The context projection and
norms are small and replicated. The Markov head runs after the gathered logits, token by
token, so it lives on rank 0 alone (rank 1 never needs it).

DSparkModel.block_logits runs unchanged on the sharded model: its `embed` and `head` are
VocabParallel views that index and multiply like the tensors they replace.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from remote_drafter.models.dspark import DSparkModel
from remote_drafter.models.llama_layers import MLP, Attention

WORLD = 2


def bounds(n: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank's part of n items: rank 0 takes the larger half."""
    first = (n + 1) // 2
    return (0, first) if rank == 0 else (first, n)


def check_shardable(model: DSparkModel) -> None:
    c = model.config
    if c.num_kv_heads < WORLD:
        raise ValueError(f"tensor parallel {WORLD} splits key/value heads: this drafter has "
                         f"{c.num_kv_heads}")
    if c.ffn < WORLD or c.vocab_size < WORLD:
        raise ValueError("the feed-forward width and vocabulary must have at least 2 entries")


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    return layer


class Tally:
    """The collectives a rank has run, by name: calls and bytes (a round's are the totals'
    change over that round)."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.bytes[name] = self.bytes.get(name, 0) + t.numel() * t.element_size()

    def snapshot(self) -> dict:
        return {name: {"calls": self.calls[name], "bytes": self.bytes[name]} for name in sorted(self.calls)}


class Reducer:
    """Sums a partial result over the two ranks (in place; the data-plane group)."""

    def __init__(self, group, tally: Tally | None = None, name: str = "all-reduce"):
        self.group, self.tally, self.name = group, tally, name

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        dist.all_reduce(t, group=self.group)
        if self.tally is not None:
            self.tally.add(self.name, t)
        return t


class ShardedAttention(Attention):
    def __init__(self, full: Attention, rank: int, reduce: Reducer):
        nn.Module.__init__(self)
        group, hd = full.heads // full.kv_heads, full.head_dim
        lo, hi = bounds(full.kv_heads, rank)
        self.heads, self.kv_heads, self.head_dim, self.theta = (hi - lo) * group, hi - lo, hd, full.theta
        q, kv = slice(lo * group * hd, hi * group * hd), slice(lo * hd, hi * hd)
        self.q_proj = _linear(full.q_proj.weight[q])
        self.k_proj = _linear(full.k_proj.weight[kv])
        self.v_proj = _linear(full.v_proj.weight[kv])
        self.o_proj = _linear(full.o_proj.weight[:, q])
        self.reduce = reduce

    def forward(self, x, kv, q_pos, kv_pos, allowed):
        return self.reduce(super().forward(x, kv, q_pos, kv_pos, allowed))


class ShardedMLP(MLP):
    def __init__(self, full: MLP, rank: int, reduce: Reducer):
        nn.Module.__init__(self)
        lo, hi = bounds(full.gate_proj.weight.shape[0], rank)
        self.gate_proj = _linear(full.gate_proj.weight[lo:hi])
        self.up_proj = _linear(full.up_proj.weight[lo:hi])
        self.down_proj = _linear(full.down_proj.weight[:, lo:hi])
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(super().forward(x))


class VocabParallel:
    """This rank's rows of a [vocab, hidden] matrix, used as the embedding (`w[ids]`) and as
    the output head (`x @ w.T`, or called: x -> x @ W.T), both returning full, replicated
    results."""

    def __init__(self, full: torch.Tensor, rank: int, group, tally: Tally | None = None):
        self.vocab, self.group, self.tally = full.shape[0], group, tally
        self.lo, self.hi = bounds(self.vocab, rank)
        self.rows = (self.vocab + 1) // 2  # both shards padded to this: all_gather wants equal sizes
        shard = full.new_zeros(self.rows, full.shape[1])
        shard[: self.hi - self.lo] = full[self.lo:self.hi]
        self.weight = shard

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def to(self, device=None, dtype=None) -> VocabParallel:
        self.weight = self.weight.to(device=device, dtype=dtype)
        return self

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        local = self.weight[(ids - self.lo).clamp(0, self.rows - 1)]
        out = torch.where(mine[..., None], local, torch.zeros_like(local))
        dist.all_reduce(out, group=self.group)  # the other rank adds exact zeros
        if self.tally is not None:
            self.tally.add("embedding all-reduce", out)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.T

    @property
    def T(self) -> _Head:  # noqa: N802 - mirrors Tensor.T, which block_logits calls
        return _Head(self)


class _Head:
    def __init__(self, shard: VocabParallel):
        self.shard = shard

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shard
        local = (x @ s.weight.T).contiguous()
        parts = [torch.empty_like(local) for _ in range(WORLD)]
        dist.all_gather(parts, local, group=s.group)
        if s.tally is not None:
            s.tally.add("head all-gather", local)
        return torch.cat([parts[0][..., : s.rows], parts[1][..., : s.vocab - s.rows]], -1)


def shard_model(model: DSparkModel, rank: int, group) -> DSparkModel:
    """Turn a loaded (CPU, full) DSparkModel into rank's shard, in place; returns it."""
    check_shardable(model)
    reduce = Reducer(group)
    for block in model.layers:
        block.self_attn = ShardedAttention(block.self_attn, rank, reduce)
        block.mlp = ShardedMLP(block.mlp, rank, reduce)
    embed, head = model._buffers.pop("embed"), model._buffers.pop("head")
    shared = VocabParallel(embed, rank, group)
    model.embed = shared
    model.head = shared if head is embed or torch.equal(head, embed) else VocabParallel(head, rank, group)
    if rank != 0:
        del model.markov  # only the picking rank runs the Markov head
    return model


def move(model: DSparkModel, device: str, dtype: torch.dtype) -> DSparkModel:
    """nn.Module.to() for the sharded model (the vocab-parallel views are not buffers)."""
    model.to(device=device, dtype=dtype)
    model.embed.to(device, dtype)
    if model.head is not model.embed:
        model.head.to(device, dtype)
    return model
