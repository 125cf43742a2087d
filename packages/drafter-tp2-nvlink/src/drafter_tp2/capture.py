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

from remote_drafter.drafters.dspark import DSparkModel


class Rounds:
    def __init__(self, model: DSparkModel, device: str, graphs: bool, buckets: list[int]):
        self.model, self.device = model, device
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, static inputs, static output)
        self.want_graphs, self.buckets = graphs and self.cuda, sorted(buckets)

    def describe(self) -> dict:
        if not self.cuda:
            return {"stream": "cpu: default (no CUDA streams)", "graphs": "cpu: none (eager rounds)"}
        return {"stream": "owned", "graphs": sorted(self.graphs) or "off (eager rounds)",
                "graphs_tested_on_gpu": False}

    @torch.inference_mode()
    def capture(self, window: int, feature: int) -> None:
        """Capture every bucket (both ranks call this at start-up, in the same order)."""
        if not self.want_graphs:
            return
        for b in self.buckets:
            static = self._blank(b, window, feature)
            with torch.cuda.stream(self.stream):
                for _ in range(2):  # warm-up: lazy kernel choices and allocations before capture
                    self.model.block_logits(*static)
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                out = self.model.block_logits(*static)
            self.graphs[b] = (graph, static, out)

    def _blank(self, b: int, window: int, feature: int) -> tuple[torch.Tensor, ...]:
        dev = self.device
        ctx = (torch.zeros(b, window, feature, device=dev) if feature
               else torch.zeros(b, window, dtype=torch.int64, device=dev))
        return (ctx, torch.zeros(b, window, dtype=torch.bool, device=dev),
                torch.zeros(b, window, dtype=torch.int64, device=dev),
                torch.zeros(b, dtype=torch.int64, device=dev),
                torch.zeros(b, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if not self.cuda:
            return self.model.block_logits(*inputs)
        b = inputs[1].shape[0]
        bucket = next((x for x in self.buckets if x >= b and x in self.graphs), None)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # inputs were made there
        with torch.cuda.stream(self.stream):
            if bucket is None:
                z = self.model.block_logits(*inputs)
            else:
                graph, static, out = self.graphs[bucket]
                for dst, src in zip(static, inputs):
                    dst.zero_()
                    dst[:b].copy_(src)
                graph.replay()
                z = out[:b].clone()
        self.stream.synchronize()
        return z
