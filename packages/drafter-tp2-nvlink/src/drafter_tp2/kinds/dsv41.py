"""DeepSeek-V4.1's (and V4's) own drafter on a pair, by experts: each rank reads and holds
only its contiguous half of every layer's routed experts (rank 0 the larger half); a round
routes once, identically on both ranks (the stream entering each MoE is the same on both),
each rank runs the chosen experts it holds, and one all-reduce per MoE layer adds the two
partial sums (the shared expert is rank 0's). The embedding and the head are vocab-parallel
(sharding.VocabParallel); attention, the mixes, norms, the Markov and confidence heads are
replicated, so both ranks compute the round's greedy chain and rank 0's is returned.

The ranks' per-tensor digests, exchanged before anything is built, give the pair the same
identity as a one-card worker on that checkpoint; tensors both ranks read but hold
differently are refused by name. An EXL3 pack is served only once its fidelity gate passed
for exactly those weights (remote-drafter's exl3_admission, as the one-card worker checks it;
there is no --ungated here)."""

from __future__ import annotations

from dataclasses import asdict

import torch

from remote_drafter.engine.identity import digest_tensors
from remote_drafter.models import exl3
from remote_drafter.models.dsv41 import checkpoint, exl3_pack
from remote_drafter.models.dsv41.config import Dsv41DrafterConfig, routed_expert, weight_table
from remote_drafter.models.dsv41.drafter import Dsv41Drafter
from remote_drafter.models.dsv41.model import Dsv41Model
from remote_drafter.models.dsv41.modules.module import Dense
from remote_drafter.models.fidelity_gate import weights_of
from remote_drafter.worker import exl3_admission

from ..capture import Rounds
from ..channel import Channel
from ..sharding import Reducer, Tally, VocabParallel, bounds


class PairDrafter(Dsv41Drafter):
    """A rank's Dsv41Drafter over its shard; rank 0's description adds the topology and the
    collectives its rounds ran, as counted where Python runs them (eager rounds: a CUDA
    graph's replays run the collectives it captured unseen)."""

    topology: dict | None = None
    tally: Tally | None = None
    rounds_run = 0

    def _choose_attention(self) -> None:
        """The attention kernel's defaults on both ranks, whatever REMOTE_DRAFTER_ATTENTION
        says: the attention is replicated, and the routing agrees only while the stream
        entering each MoE is the same bits on both (forms timed per rank could differ)."""
        self.model.numerics.attend_chosen = {}

    def describe(self) -> dict:
        d = super().describe()
        if self.topology is None:
            return d
        return {**d, "topology": {**self.topology, "rounds_run": self.rounds_run,
                                  "collectives": self.tally.snapshot()}}


class LeaderRounds:
    """Rank 0's round: the inputs to rank 1, then both ranks' forward (rounds)."""

    def __init__(self, drafter: PairDrafter, channel: Channel, rounds: Rounds):
        self.drafter, self.channel, self.rounds = drafter, channel, rounds

    @property
    def graphs(self) -> dict:
        return self.rounds.graphs

    def __call__(self, *inputs):
        self.drafter.rounds_run += 1
        return self.channel.round(inputs, self.rounds)


WORKING_BYTES = 2 << 30  # beside the weights: the CUDA context, windows, graphs' pools, activations


def card_bytes(folder: str, dtype_bytes: int, cards: int = 2) -> list[int]:
    """Each rank's weight bytes on its card, from the checkpoint's headers alone (nothing
    read): its slice at `dtype_bytes` a value (float32 tensors at 4; an EXL3 pack's tensors
    as stored), the embedding and a dense head halved; with `cards` 1, the one-card worker's
    (every expert, nothing halved: what `rollback tp2-worker` puts on one card). What the
    stack's preflight holds against each card, with WORKING_BYTES beside."""
    config = Dsv41DrafterConfig.from_json(checkpoint.read_config(folder))
    pack = exl3.is_pack(folder)
    out = []
    for rank in range(cards):
        held = range(*bounds(config.n_routed_experts, rank)) if cards == 2 else range(config.n_routed_experts)
        if pack:
            sizes = {n: s.nbytes for n, s in checkpoint.stored_drafter_tensors(folder, held).items()}
        else:
            sizes = {n: _numel(shape) * (4 if storage == "f32" else dtype_bytes)
                     for n, (shape, storage) in weight_table(config, held).items()}
        halved = sum(sizes.get(n, 0) for n in ("embed.weight", "head.weight")) // 2 if cards == 2 else 0
        out.append(sum(sizes.values()) - halved)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def split(model: Dsv41Model, rank: int, group, tally: Tally) -> Dsv41Model:
    """A model holding rank's experts (Dsv41Model(..., experts=...)) made rank's shard: its
    MoE layers' partial sums added over the ranks (the shared expert rank 0's), the
    embedding and a dense head cut to rank's half of the vocabulary (an EXL3 head stays
    whole on both ranks)."""
    for layer in model.layers:
        layer.moe.adds_shared = rank == 0
        layer.moe.sum_over_ranks = Reducer(group, tally, "MoE all-reduce")
    embed = model.embedding
    embed.weight = VocabParallel(embed.weight, rank, group, tally)
    embed.own["embed.weight"] = embed.weight.weight
    if isinstance(model.head.proj, Dense):
        model.head.proj = VocabParallel(model.head.proj.weight, rank, group, tally)
        model.head.own["head.weight"] = model.head.proj.weight
    return model


class Dsv41Kind:
    sharding = ("routed experts split (each rank its contiguous half, read from the checkpoint "
                "alone), one all-reduce per MoE layer; the shared expert on rank 0; embedding "
                "and head vocab-parallel; attention, mixes, norms, Markov and confidence heads "
                "replicated")

    def __init__(self, cfg, rank: int, device: str):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.folder = cfg.drafter.removeprefix("dsv41:")
        config = Dsv41DrafterConfig.from_json(checkpoint.read_config(self.folder))
        self.held = range(*bounds(config.n_routed_experts, rank))
        pack = exl3.is_pack(self.folder)  # exllamav3's linears load onto the device itself
        if pack and (why := exl3_admission.refusal(self.folder, None)):  # before loading
            raise ValueError(why)
        self.pack = pack
        self.loaded = (exl3_pack.load if pack else checkpoint.load)(
            self.folder, getattr(torch, cfg.dtype), device if pack else "cpu", experts=self.held)
        self.tally = Tally()

    def hello(self) -> dict:
        hashes = self.loaded.tensor_digests
        replicated = sorted((n, h) for n, h in hashes.items() if routed_expert(n) is None)
        return {"fingerprint": digest_tensors((n, bytes.fromhex(h)) for n, h in replicated),
                "config": {**asdict(self.loaded.config),
                           "weights": "exl3" if getattr(self.loaded, "linears", None) else "dense"},
                "tensors": hashes, "experts": [self.held.start, self.held.stop]}

    def check(self, infos: list[dict]) -> str | None:
        """Both ranks, once they agree: the pair's identity from both ranks' digests (the
        one-card worker's), and an EXL3 pack's fidelity gate for exactly those weights."""
        c = self.loaded.config
        hashes = {**infos[0]["tensors"], **infos[1]["tensors"]}
        try:
            self.manifest = Dsv41Drafter.manifest_for(self.folder, self.cfg.target, c,
                                                      *checkpoint.digests(c, hashes))
        except ValueError as exc:
            return str(exc)
        if self.pack:
            return exl3_admission.refusal(self.folder, weights_of(self.manifest), self.manifest.target)
        return None

    def shard(self, infos: list[dict], data) -> None:
        """This rank's shard on its device."""
        c, loaded, manifest = self.loaded.config, self.loaded, self.manifest
        model = Dsv41Model(c, loaded.weights, self.device, linears=getattr(loaded, "linears", None),
                           experts=self.held)
        del self.loaded
        split(model, self.rank, data, self.tally)
        # dense_mib=0: each rank would time the dense copies on its own card and might choose
        # otherwise, and the replicated linears must compute alike on both
        self.drafter = PairDrafter(model, manifest, self.device, cuda_graphs=False, dense_mib=0)
        self.drafter.tally = self.tally

    def blank(self, b: int, c: int) -> tuple[torch.Tensor, ...]:
        """(context rows [b, window, layers, head_dim], [b, 3]: rows kept, seed, its position)."""
        return self.drafter._blank(b)

    def rounds(self, graphs: bool, buckets: list[int]) -> Rounds:
        rounds = Rounds(self.drafter._block, self.device, graphs, buckets, self.drafter._blank)
        if rounds.want_graphs:
            self.drafter.prepare_graphs()
        return rounds

    def leader(self, channel: Channel, rounds: Rounds, topology: dict) -> PairDrafter:
        self.drafter._forward = LeaderRounds(self.drafter, channel, rounds)
        self.drafter.topology = {**topology, "experts": {"rank 0": list(bounds(self.drafter.config.n_routed_experts, 0)),
                                                         "rank 1": list(bounds(self.drafter.config.n_routed_experts, 1))}}
        return self.drafter
