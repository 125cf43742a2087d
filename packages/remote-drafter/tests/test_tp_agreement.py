"""Tensor-parallel ranks agree on how they draft before any of them drafts: settings that
differ between the hosts' env files are refused on every rank with one line naming what
differs where (never one rank waiting in a broadcast the other never joins), and rank 0's
view of the worker reaches every rank. Two real processes over torch.distributed (gloo)
on loopback, as vLLM's CPU group is."""

import multiprocessing
import socket
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="needs torch.distributed: the dev venv / tools/test's unit tier runs it")

from remote_drafter.vllm.proposer import drafting_settings  # noqa: E402
from remote_drafter.vllm.tensor_parallel import agree, from_first_rank  # noqa: E402


def rank_main(rank: int, port: int, settings: dict, out) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = SimpleNamespace(world_size=2, ranks=[0, 1], cpu_group=dist.group.WORLD)
    try:
        agree(group, settings)
        out.put((rank, "agreed", from_first_rank(group, ((17, 21), 128 if rank == 0 else 0))))
    except RuntimeError as exc:
        out.put((rank, "refused", str(exc)))
    finally:
        dist.destroy_process_group()


def two_ranks(first: dict, second: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, settings, out))
             for r, settings in enumerate((first, second))]
    for p in procs:
        p.start()
    results = {rank: (what, value) for rank, what, value in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
    return results


def test_ranks_with_the_same_settings_share_rank_zeros_view_of_the_worker(monkeypatch):
    monkeypatch.setenv("REMOTE_DRAFTER_ADDRESS", "10.0.0.1:7480")
    settings = drafting_settings()
    assert two_ranks(settings, settings) == {0: ("agreed", ((17, 21), 128)),
                                            1: ("agreed", ((17, 21), 128))}


def test_settings_that_differ_are_refused_on_every_rank_with_what_differs(monkeypatch):
    monkeypatch.setenv("REMOTE_DRAFTER_ADDRESS", "10.0.0.1:7480")
    monkeypatch.setenv("REMOTE_DRAFTER_VLLM_COLLECT", "input")
    rank0 = drafting_settings()
    monkeypatch.setenv("REMOTE_DRAFTER_VLLM_COLLECT", "take")
    monkeypatch.setenv("REMOTE_DRAFTER_HIDDEN_LAYERS", "1,9,17")
    rank1 = drafting_settings()
    results = two_ranks(rank0, rank1)
    assert {what for what, _ in results.values()} == {"refused"}
    assert results[0][1] == results[1][1]  # the same line on both
    assert ("collection: rank 0 'input', rank 1 'take'; hidden_layers: rank 0 'auto', rank 1 "
            "'1,9,17'") in results[0][1]
    assert results[0][1].count("\n") == 0
