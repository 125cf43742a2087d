"""GPU tier: needs CUDA, so CI skips it; benchmarks/gpu.sh runs it on an H200 machine."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.decode_loop import plain_decode, speculative_decode  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.identity import Manifest, expectation  # noqa: E402
from remote_drafter.engine.rows import BFLOAT16, cast  # noqa: E402
from remote_drafter.engine.transport import RemoteTransport  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint, tiny  # noqa: E402
from remote_drafter.models.dsv41.drafter import Dsv41Drafter  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402
from remote_drafter.models.llama import LlamaLM  # noqa: E402
from remote_drafter.models.registry import load_drafter  # noqa: E402
from remote_drafter.models.staging import RowStage  # noqa: E402
from remote_drafter.testing import HIDDEN_LAYERS, WorkerProcess, draft_agreement  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU tier: no CUDA here; benchmarks/gpu.sh runs it on an H200")


def test_cuda_drafts_equal_cpu_drafts_at_greedy(models):
    cpu = load_drafter(models["dspark"], models["target"], "cpu")
    gpu = load_drafter(models["dspark"], models["target"], "cuda")
    rng = np.random.default_rng(0)
    on_cpu, on_gpu = [], []
    for _ in range(20):
        h = cpu.new_history()
        n = int(rng.integers(2, 40))
        h.reset(rng.integers(0, cpu.vocab_size, n).astype(np.int32),
                rng.standard_normal((n - 1, cpu.feature)).astype(np.float32))
        on_cpu += cpu.draft([DraftRequest(h, 5)], True)
        on_gpu += gpu.draft([DraftRequest(h, 5)], True)
    gaps = draft_agreement(on_cpu, on_gpu)["top_two_gaps_where_they_part"]
    assert all(g < 1e-3 for g in gaps), f"differences away from near-ties: top-2 gaps {gaps}"


def test_a_cuda_worker_keeps_decoding_exact(models):
    worker = WorkerProcess(models["dspark"], models["target"], "tcp", 0, "--device", "cuda")
    try:
        target = LlamaLM.load(models["target"])
        client = DrafterClient(RemoteTransport(worker.address, "tcp", expectation(models["target"], None)),
                               "8:5", deadline_s=10)
        prompts = {1: [1, 2, 3, 4, 5], 2: list(range(10, 40))}
        result = speculative_decode(target, client, prompts, 24, hidden_layers=HIDDEN_LAYERS)
        assert result.tokens == {r: plain_decode(target, p, 24) for r, p in prompts.items()}
        assert client.counters()["drafts"] > 0 and client.counters()["rounds_failed"] == 0
    finally:
        worker.stop()


def test_the_pinned_row_stage_delivers_each_round_whole():
    """A round's rows through the reused pinned buffer, with no host synchronisation between
    rounds: each arrives whole, also when the buffer grows or is rewritten while an earlier
    copy out of it may still run (float32 and bf16 rows)."""
    stage = RowStage("cuda")
    rng = np.random.default_rng(1)
    sent = []
    for n in (3, 100, 7, 5000, 2, 5000):
        parts = [rng.standard_normal((n, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)]
        sent.append((stage.to_device(parts), np.concatenate(parts)))
        rows = cast(rng.standard_normal((n, 8)).astype(np.float32), BFLOAT16)
        sent.append((stage.to_device([rows[:1], rows[1:]]), rows))
    for got, want in sent:
        assert got.device.type == "cuda"
        host = got.view(torch.int16).cpu().numpy().view(BFLOAT16) if got.dtype == torch.bfloat16 else got.cpu().numpy()
        assert np.array_equal(host, want)


def test_a_graphed_dsv41_drafter_with_new_rows_each_round_drafts_as_the_cpu_one(tmp_path):
    """Rounds as the worker runs them, in CUDA graphs: histories that grow between rounds (new
    rows through the pinned buffer and encoded, no host synchronisation inside the round), 1
    to 4 requests in turn (buckets 1, 2 and 4, padded and exact, each replayed after another:
    the buckets share one memory pool), and a round holding two snapshots of one request
    (laid out in two parts, the buffer reused within the round): greedy drafts as the
    float32 CPU drafter's, parting only at near-ties."""
    tiny.write_tiny(str(tmp_path))
    loaded = checkpoint.load(str(tmp_path), torch.float32, "cpu")
    manifest = Manifest("tiny", "tiny", "tiny", "tiny", Dsv41Drafter.kind)
    cpu = Dsv41Drafter(Dsv41Model(loaded.config, loaded.weights, "cpu"), manifest, "cpu")
    gpu = Dsv41Drafter(Dsv41Model(loaded.config, loaded.weights, "cuda"), manifest, "cuda", cuda_graphs=True)
    assert gpu.describe()["cuda_graphs"] != "off (eager rounds)"
    rng = np.random.default_rng(0)

    def grow(h, n):
        h.extend(rng.integers(0, cpu.vocab_size, n).astype(np.int32),
                 rng.standard_normal((n, cpu.feature)).astype(np.float32))
    histories = [cpu.new_history() for _ in range(4)]
    for i, h in enumerate(histories):
        h.reset(np.array([7], np.int32), None)
        grow(h, 20 + 5 * i)
    on_cpu, on_gpu = [], []
    for r in range(8):
        batch = histories[:1 + r % 4]
        if r == 5:  # an older snapshot of the first request beside it
            older = copy.copy(histories[0])
            grow(histories[0], 2)
            batch = [older, *batch]
        requests = [DraftRequest(h, cpu.max_depth) for h in batch]
        on_cpu += cpu.draft(requests, False)
        on_gpu += gpu.draft(requests, False)
        for h in histories:
            grow(h, 1 + r % 3)
    agreement = draft_agreement(on_cpu, on_gpu)
    assert all(g < 1e-3 for g in agreement["top_two_gaps_where_they_part"]), agreement
