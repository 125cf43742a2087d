"""GPU tier: needs CUDA, so CI skips it; benchmarks/gpu.sh runs it on an H200 machine."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.decode_loop import plain_decode, speculative_decode  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.identity import expectation  # noqa: E402
from remote_drafter.engine.transport import RemoteTransport  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.llama import LlamaLM  # noqa: E402
from remote_drafter.models.registry import load_drafter  # noqa: E402
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
