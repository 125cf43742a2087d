"""GPU tier: needs two CUDA devices, so CI skips it; benchmarks/gpu.sh runs it on an
nvidia-h200-x2 machine (with the latency table and the fault drill). UNTESTED until then."""

import subprocess

import pytest
import torch
from tp2_support import PairProcess, drafter_tp2, tp2_env, worker_args

from drafter_tp2.parity import compare_single_rounds
from remote_drafter.client import DrafterClient
from remote_drafter.drafters import load_drafter
from remote_drafter.identity import expectation
from remote_drafter.transport import RemoteTransport

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="GPU tier: needs two CUDA devices; packages/drafter-tp2-nvlink/benchmarks/gpu.sh "
           "runs it on an nvidia-h200-x2 machine")
CUDA = "cuda:0,cuda:1"


def drafts_against_one_card(models, address, rounds=60):
    one = load_drafter(models["dspark"], models["target"], "cuda:0")
    client = DrafterClient(RemoteTransport(address, "tcp", expectation(models["target"], None)),
                           "8:5", deadline_s=5.0)
    return compare_single_rounds(client, one, rounds, 40, seed=3)["difference_top2_gaps"]


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


def test_the_same_gpu_twice_is_refused(models, lock_dir):
    p = drafter_tp2("worker", *worker_args(models, "cuda:0,cuda:0"), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, env=tp2_env())
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "the same device twice" in err, err
