"""A round's forward captured as one CUDA graph per batch bucket, on a stream the worker
owns, and replayed (the one-card dsv41 drafter and drafter-tp2's ranks use it).

`fn(*inputs)` takes batch-first tensors and returns a tensor or a tuple of them, batch
first, with no host synchronisation inside (a graph replays device work only). A call is
padded up to the smallest captured bucket that holds it (padding rows are zeros, which the
caller's fn must tolerate, and are dropped) and replayed on the caller's stream; a batch
above every bucket runs eagerly on the owned stream, which the caller's stream then waits
for (no host synchronisation: work queued after the call, on the caller's stream, sees the
outputs). A replay's outputs are views of the graph's own buffers: read them before the
next call (the worker's device lock runs one round at a time). On CPU: no streams, no
graphs, fn runs as called."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable

import torch


@contextlib.contextmanager
def no_collection():
    """Python's cyclic garbage collector run first, then kept off, for a graph's capture: a dead
    cycle holding another CUDA graph (an earlier drafter's) collected mid-capture destroys that
    graph, which the driver refuses while a stream captures, and the capture fails. torch's
    capture no longer collects first by default."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def side_stream_graph(fn, device) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn() warmed up on a side stream, then captured there: (the graph, fn's output in it).
    The caller's stream is current again afterwards, also when the capture fails (torch
    restores it only after ending the capture, which may be what raises)."""
    caller = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        fn()  # warm-up before capture: lazy kernel choices and allocations
    graph = torch.cuda.CUDAGraph()
    try:
        with no_collection(), torch.cuda.graph(graph, stream=stream):
            out = fn()
    finally:
        torch.cuda.set_stream(caller)
    return graph, out


def bucket_for(keys, n: int, past_all=None):
    """The smallest of `keys` at or above n; past them all, `past_all`."""
    return min((k for k in keys if k >= n), default=past_all)


def graph_ms(fn, device, replays: int = 20) -> float:
    """ms of fn() captured in a CUDA graph (side_stream_graph): the median replay."""
    graph, _ = side_stream_graph(fn, device)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class BucketGraphs:
    def __init__(self, fn: Callable, device: str):
        self.fn, self.device = fn, device
        self.cuda = torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, static inputs, static outputs)

    @torch.inference_mode()
    def capture(self, buckets: list[int], blank: Callable[[int], tuple]) -> None:
        """Capture `fn` on `blank(b)` (zero inputs of batch b) for every bucket b, largest
        first, all in one memory pool: a replay's intermediates lie where any other bucket's
        do, so the buckets together hold about the largest one's (outputs stay apart: each
        graph holds its own, which callers read before the next call)."""
        if not self.cuda:
            return
        pool = torch.cuda.graph_pool_handle()
        for b in sorted(buckets, reverse=True):
            static = blank(b)  # made on the current stream: the owned one waits for it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for _ in range(2):  # warm-up: lazy kernel choices and allocations before capture
                    self.fn(*static)
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with no_collection(), torch.cuda.graph(graph, pool=pool, stream=self.stream):
                out = self.fn(*static)
            self.graphs[b] = (graph, static, out)

    @torch.inference_mode()
    def __call__(self, *inputs: torch.Tensor):
        if not self.cuda:
            return self.fn(*inputs)
        b = inputs[0].shape[0]
        bucket = bucket_for(self.graphs, b)
        if bucket is None:  # eagerly on the owned stream, between the caller's work before and after
            caller = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(caller)
            with torch.cuda.stream(self.stream):
                out = self.fn(*inputs)
            caller.wait_stream(self.stream)
            return out
        # A replay needs no stream of its own: on the caller's, in order with what it queued
        # before (the inputs) and after (reading the outputs), with no cross-stream events.
        graph, static, captured = self.graphs[bucket]
        for dst, src in zip(static, inputs):
            dst[:b].copy_(src)
            if b < bucket:
                dst[b:].zero_()  # padding rows: zeros, not the last round's
        graph.replay()
        return tuple(t[:b] for t in captured) if isinstance(captured, tuple) else captured[:b]
