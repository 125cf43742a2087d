"""The Llama-style DSpark drafter on a pair: Megatron-style tensor parallel (sharding.py);
DSparkModel.block_logits runs unchanged on the shard."""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from remote_drafter.models.dspark import DSparkDrafter

from ..capture import Rounds
from ..channel import Channel
from ..sharding import move, shard_model


class TP2Drafter(DSparkDrafter):
    """Rank 0's drafter: DSparkDrafter.draft as it is, over the sharded model; its
    description adds the topology (the only thing a client sees differ)."""

    def __init__(self, base: DSparkDrafter, model: nn.Module, device: str, topology: dict):
        super().__init__(base.config, model, base.manifest(), device)
        self.topology = topology

    def describe(self) -> dict:
        return {**super().describe(), "topology": self.topology}


class LeaderModel(nn.Module):
    """What TP2Drafter.draft calls: each block_logits is a round of the pair."""

    def __init__(self, shard: nn.Module, channel: Channel, rounds: Rounds):
        super().__init__()
        self.shard, self.markov = shard, shard.markov
        self.channel, self.rounds = channel, rounds

    def block_logits(self, *inputs) -> torch.Tensor:
        return self.channel.round(inputs, self.rounds)


class DSparkKind:
    sharding = ("q/k/v, gate/up column-parallel; o, down row-parallel; embedding/head "
                "vocab-parallel; Markov head on rank 0")

    def __init__(self, cfg, rank: int, device: str):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.drafter = DSparkDrafter.load(cfg.drafter, cfg.target, "cpu")  # full, then sharded

    def hello(self) -> dict:
        return {"fingerprint": self.drafter.manifest().fingerprint.hex(),
                "config": asdict(self.drafter.config)}

    def check(self, infos: list[dict]) -> str | None:
        return None  # both ranks loaded the whole checkpoint: pair.refusals compared them

    def shard(self, infos: list[dict], data) -> None:
        self.model = move(shard_model(self.drafter.model, self.rank, data), self.device,
                          getattr(torch, self.cfg.dtype))

    def blank(self, b: int, c: int) -> tuple[torch.Tensor, ...]:
        """(context rows [b, c, feature] or token ids, validity, positions, anchor, its position)."""
        dev, feature = self.device, self.drafter.feature
        ctx = (torch.zeros(b, c, feature, device=dev) if feature
               else torch.zeros(b, c, dtype=torch.int64, device=dev))
        return (ctx, torch.zeros(b, c, dtype=torch.bool, device=dev),
                torch.zeros(b, c, dtype=torch.int64, device=dev),
                torch.zeros(b, dtype=torch.int64, device=dev), torch.zeros(b, dtype=torch.int64, device=dev))

    def rounds(self, graphs: bool, buckets: list[int]) -> Rounds:
        return Rounds(self.model.block_logits, self.device, graphs, buckets,
                      lambda b: self.blank(b, self.drafter.window))

    def leader(self, channel: Channel, rounds: Rounds, topology: dict) -> TP2Drafter:
        return TP2Drafter(self.drafter, LeaderModel(self.model, channel, rounds), self.device, topology)
