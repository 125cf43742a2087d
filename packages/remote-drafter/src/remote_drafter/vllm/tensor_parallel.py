"""One round per TP group: only TP rank 0 talks to the worker; deferred drafts reach the
other ranks in one broadcast on the group's CPU group, so every rank's inputs are the same."""

from __future__ import annotations

from .versions import SHARED_SOURCES, refusal


def shared_group(vllm_config):
    """(vLLM's TP group, None) when TP rank 0's round serves the whole group, else (None, why
    not); (None, None) with one rank."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size == 1:
        return None, None
    if parallel.pipeline_parallel_size * parallel.prefill_context_parallel_size > 1:
        return None, "pipeline or prefill context parallel: the drafts' rank is not TP rank 0"
    if parallel.distributed_executor_backend != "mp":
        return None, f"executor {parallel.distributed_executor_backend!r}, not vLLM's multiprocessing one"
    why = refusal(SHARED_SOURCES)
    if why:
        return None, why
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group(), None


def broadcast_drafts(group, drafts: dict[str, list[int]], scheduled: dict[str, list[int]],
                     ) -> dict[str, list[int]]:
    """TP rank 0's drafts for every request scheduled with drafts (`drafts` at rank 0, the
    scheduled tokens where it has none), on every rank: one broadcast of a tensor whose
    layout each rank reads from the scheduler's output, the same on all."""
    import torch
    import torch.distributed as dist
    flat = [t for rid, want in scheduled.items() for t in drafts.get(rid, want)]
    tensor = torch.tensor(flat, dtype=torch.int32)
    dist.broadcast(tensor, src=group.ranks[0], group=group.cpu_group)
    values, out, start = tensor.tolist(), {}, 0
    for rid, want in scheduled.items():
        out[rid] = values[start:start + len(want)]
        start += len(want)
    return out
