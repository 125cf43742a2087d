"""The decode round's forward on this rank's shard (the drafter kind's round function: DSpark's
block_logits, DeepSeek's block with its greedy chain), run on a stream the worker owns and,
on CUDA, captured as CUDA graphs at start-up.

CUDA: one graph per batch bucket (DRAFTER_TP2_GRAPH_BATCHES), captured on the owned
stream before the worker accepts anyone, with the collectives inside; a round is padded to
its bucket (padding rows see no context, only their own block, and are dropped) and
replayed; rounds above the largest bucket run eagerly on the owned stream. Both ranks
capture the same buckets in the same order, so their collectives match. CPU: no graphs, no
streams; rounds run eagerly (`describe()` says so).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from remote_drafter.models.cuda_graphs import BucketGraphs


class Rounds:
    """fn(*inputs) -> the round's outputs; blank(b) -> a round's inputs for b requests (zeros)."""

    def __init__(self, fn: Callable, device: str, graphs: bool, buckets: list[int],
                 blank: Callable[[int], tuple[torch.Tensor, ...]]):
        self.device, self.blank = device, blank
        self.run = BucketGraphs(fn, device)
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
        return {"stream": "owned", "graphs": sorted(self.graphs) or "off (eager rounds)"}

    def capture(self) -> None:
        """Capture every bucket (both ranks call this at start-up, in the same order)."""
        if self.want_graphs:
            self.run.capture(self.buckets, self.blank)

    def __call__(self, inputs: tuple[torch.Tensor, ...]):
        return self.run(*inputs)
