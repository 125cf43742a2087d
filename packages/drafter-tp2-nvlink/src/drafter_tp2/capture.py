"""The decode round's forward (DSparkModel.block_logits on this rank's shard), run on a
stream the worker owns and, on CUDA, captured as CUDA graphs at start-up.

CUDA: one graph per batch bucket (DRAFTER_TP2_GRAPH_BATCHES), captured on the owned
stream before the worker accepts anyone, with the NCCL collectives inside; a round is
padded up to its bucket (padding rows see no context, only their own block, and are
dropped) and replayed; rounds above the largest bucket run eagerly on the owned stream.
Both ranks capture the same buckets in the same order, so their collectives match.
UNTESTED ON GPU until benchmarks/gpu.sh has run on an H200 pair (it compares replayed
with eager drafts). CPU: no graphs, no streams; rounds run eagerly (`describe()` says so).
"""

from __future__ import annotations

import torch

from remote_drafter.models.cuda_graphs import BucketGraphs
from remote_drafter.models.dspark import DSparkModel


class Rounds:
    def __init__(self, model: DSparkModel, device: str, graphs: bool, buckets: list[int]):
        self.model, self.device = model, device
        self.run = BucketGraphs(model.block_logits, device)
        self.want_graphs, self.buckets = graphs and self.run.cuda, sorted(buckets)

    @property
    def stream(self):
        return self.run.stream

    @property
    def graphs(self) -> dict[int, tuple]:
        return self.run.graphs

    def describe(self) -> dict:
        if not self.run.cuda:
            return {"stream": "cpu: default (no CUDA streams)", "graphs": "cpu: none (eager rounds)"}
        return {"stream": "owned", "graphs": sorted(self.graphs) or "off (eager rounds)",
                "graphs_tested_on_gpu": False}

    def capture(self, window: int, feature: int) -> None:
        """Capture every bucket (both ranks call this at start-up, in the same order)."""
        if self.want_graphs:
            self.run.capture(self.buckets, lambda b: self._blank(b, window, feature))

    def _blank(self, b: int, window: int, feature: int) -> tuple[torch.Tensor, ...]:
        dev = self.device
        ctx = (torch.zeros(b, window, feature, device=dev) if feature
               else torch.zeros(b, window, dtype=torch.int64, device=dev))
        return (ctx, torch.zeros(b, window, dtype=torch.bool, device=dev),
                torch.zeros(b, window, dtype=torch.int64, device=dev),
                torch.zeros(b, dtype=torch.int64, device=dev),
                torch.zeros(b, dtype=torch.int64, device=dev))

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return self.run(*inputs)
