"""One round per TP group: only TP rank 0 talks to the worker; deferred drafts reach the
other ranks in one broadcast on the group's CPU group, so every rank's inputs are the same.
That needs every rank to draft the same way: the ranks compare their settings at start-up
and share rank 0's view of the worker, so a mismatch is refused on every rank, never left
to hang one rank in a broadcast the other never joins."""

from __future__ import annotations

from .versions import SHARED_SOURCES, refusal


def tp_group(vllm_config):
    """vLLM's TP group (a GroupCoordinator), None with one rank."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group()


def agree(group, mine: dict) -> None:
    """Every rank of `group` holds the same settings `mine`, else every rank raises with one
    line naming what differs where (all of them see all the settings, so all refuse)."""
    import torch.distributed as dist
    every: list = [None] * group.world_size
    dist.all_gather_object(every, mine, group=group.cpu_group)
    differ = sorted({k for theirs in every for k in {*theirs, *mine} if theirs.get(k) != every[0].get(k)})
    if differ:
        raise RuntimeError(
            "remote drafter settings differ across the tensor-parallel ranks ("
            + "; ".join(f"{k}: " + ", ".join(f"rank {r} {theirs.get(k)!r}" for r, theirs in enumerate(every))
                        for k in differ)
            + "): give every engine host the same drafter settings")


def from_first_rank(group, value):
    """TP rank 0's `value` (a small picklable object) on every rank of `group`."""
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
    return box[0]


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
    return tp_group(vllm_config), None


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
