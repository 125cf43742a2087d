"""GPU tier, never in CI (no GPU there): benchmarks/gpu.sh runs it. The one-GPU tests (graph
capture on an owned stream, the card's lock against both kinds of worker, the same GPU
twice) ran on an nvidia-h200; the two-GPU tests need an nvidia-h200-x2 machine."""

import subprocess
import sys

import pytest
import torch

from drafter_tp2.parity import compare_single_rounds
from drafter_tp2.testing import PairProcess, drafter_tp2, tp2_env, worker_args
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.transport import RemoteTransport
from remote_drafter.models.registry import load_drafter

ONE_GPU = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU tier: needs a CUDA device; packages/drafter-tp2-nvlink/benchmarks/gpu.sh runs "
           "it on an nvidia-h200 machine")
TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="GPU tier: needs two CUDA devices; packages/drafter-tp2-nvlink/benchmarks/gpu.sh "
           "runs it on an nvidia-h200-x2 machine")
CUDA = "cuda:0,cuda:1"


def drafts_against_one_card(models, address, rounds=60):
    one = load_drafter(models["dspark"], models["target"], "cuda:0")
    client = DrafterClient(RemoteTransport(address, "tcp", expectation(models["target"], None)),
                           "8:5", deadline_s=5.0)
    return compare_single_rounds(client, one, rounds, 40, seed=3)["difference_top2_gaps"]


@TWO_GPUS
@pytest.mark.parametrize("graphs", ["auto", "0"])
def test_pair_check_capture_and_parity_on_two_gpus(models, lock_dir, graphs):
    w = PairProcess(worker_args(models, CUDA), tp2_env(DRAFTER_TP2_CUDA_GRAPHS=graphs))
    try:
        client = DrafterClient(RemoteTransport(w.address, "tcp", expectation(models["target"], None)))
        topology = client.transport.info(10).described["drafter"]["topology"]
        assert topology["peer"].startswith("P2P yes"), topology
        assert topology["rounds"]["stream"] == "owned"
        assert topology["rounds"]["graphs"] == ([1, 2, 4, 8, 16] if graphs == "auto" else "off (eager rounds)")
        gaps = drafts_against_one_card(models, w.address)
        assert all(g < 1e-3 for g in gaps), f"differences away from near-ties: {gaps}"
    finally:
        w.stop()


@ONE_GPU
def test_the_same_gpu_twice_is_refused(models, lock_dir):
    p = drafter_tp2("worker", *worker_args(models, "cuda:0,cuda:0"), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, env=tp2_env())
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "the same device twice" in err, err


def random_round(b: int, window: int, feature: int, vocab: int, g: torch.Generator) -> tuple:
    """One decode round's inputs (no zeros: a partly valid window of random rows)."""
    valid = torch.rand(b, window, generator=g) < 0.8
    valid[:, -1] = True
    return (torch.randn(b, window, feature, generator=g), valid,
            torch.arange(window).repeat(b, 1), torch.randint(0, vocab - 1, (b,), generator=g),
            torch.full((b,), window))


@ONE_GPU
def test_rounds_captured_on_an_owned_stream_replay_the_eager_round(models):
    """capture.Rounds on the one-card model (no collectives): every bucket is captured on
    the worker's own stream at start-up; a round padded to its bucket and replayed gives
    the eager round's logits, and rounds above the largest bucket run eagerly."""
    from drafter_tp2.capture import Rounds
    drafter = load_drafter(models["dspark"], models["target"], "cuda:0")

    def blank(b):
        return tuple(torch.zeros_like(t, device="cuda:0") for t in random_round(
            b, drafter.window, drafter.feature, drafter.vocab_size, torch.Generator()))
    rounds = Rounds(drafter.model.block_logits, "cuda:0", True, [1, 2, 4], blank)
    rounds.capture()
    assert rounds.describe()["stream"] == "owned" and sorted(rounds.graphs) == [1, 2, 4]
    assert rounds.stream != torch.cuda.default_stream("cuda:0")
    g = torch.Generator().manual_seed(5)
    for b in (1, 3, 4, 6):  # exact bucket, padded, exact, above every bucket
        inputs = tuple(t.to("cuda:0") for t in random_round(b, drafter.window, drafter.feature,
                                                            drafter.vocab_size, g))
        with torch.inference_mode():
            eager = drafter.model.block_logits(*inputs)
        replayed = rounds(inputs)
        assert replayed.shape == eager.shape and torch.isfinite(replayed).all()
        err = (replayed - eager).norm() / eager.norm()
        assert err < 1e-5, (b, float(err))
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1)), b


@ONE_GPU
def test_a_gpu_held_by_the_one_card_worker_refuses_a_pair_and_a_second_worker(models, lock_dir):
    """The lock's real key on a GPU: its UUID (auto mode locks GPUs without being asked)."""
    from remote_drafter.worker.device_lock import device_key
    from remote_drafter.worker.server import spawn_worker
    one_card = ["--drafter", models["dspark"], "--target", models["target"], "--listen",
                "127.0.0.1:0", "--device", "cuda:0"]
    env = tp2_env(REMOTE_DRAFTER_DEVICE_LOCK="auto", DRAFTER_TP2_REQUIRE_P2P="0")
    holder, _ = spawn_worker(one_card, env=env)
    try:
        second = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker", *one_card],
                                capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 2, second
        assert f"device {device_key('cuda:0')} is in use" in second.stderr, second.stderr
        assert device_key("cuda:0").startswith("GPU-") and f"locked by pid {holder.pid}" in second.stderr
        pair = drafter_tp2("worker", *worker_args(models, "cuda:0,cpu:1"), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=env)
        _, err = pair.communicate(timeout=120)
        assert pair.returncode == 2 and f"locked by pid {holder.pid}" in err, err
    finally:
        holder.terminate()
        holder.wait(timeout=60)
    assert holder.returncode == 0
