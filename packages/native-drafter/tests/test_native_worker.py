"""`remote-drafter worker --kernels native`: refused (one clear line, exit 2) without a
recorded gate pass; after `native-drafter gate` passes, it serves the same drafts as
`--kernels torch`. On machines without a GPU the kernels run under TRITON_INTERPRET=1 (set
for the worker processes too); benchmarks/kernels.sh does the same on the H200 with the
trained checkpoint and real states."""

import os
import subprocess
import sys

import numpy as np
from native_kernel_support import DEVICE, tiny_checkpoint

from native_drafter import kernels
from native_drafter.backend import NativeDSparkDrafter
from native_drafter.cli import main as native_drafter
from native_drafter.worker_check import compare_workers
from remote_drafter.engine.history import History
from remote_drafter.models.base import DraftRequest
from remote_drafter.models.dspark import DSparkDrafter


def worker_env(state: str) -> dict:
    env = {**os.environ, "NATIVE_DRAFTER_STATE": state}
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


def test_refused_without_a_gate_pass(tmp_path):
    ckpt, target = tiny_checkpoint(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker", "--listen", "127.0.0.1:0",
                           "--drafter", ckpt, "--target", target, "--device", DEVICE, "--kernels", "native"],
                          env=worker_env(str(tmp_path / "state")), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no recorded gate pass" in proc.stderr and "native-drafter gate" in proc.stderr
    assert proc.stderr.count("\n") == 1  # one line, no traceback


def test_refused_for_drafters_without_native_kernels(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker", "--drafter", "ngram",
                           "--kernels", "native"], env=worker_env(str(tmp_path)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "DSpark checkpoints only" in proc.stderr


def test_after_the_gate_the_native_worker_drafts_what_the_torch_worker_drafts(tmp_path, capsys, monkeypatch):
    ckpt, target = tiny_checkpoint(tmp_path)
    state = str(tmp_path / "state")
    monkeypatch.setenv("NATIVE_DRAFTER_STATE", state)
    assert native_drafter(["gate", "--checkpoint", ckpt, "--target", target, "--device", DEVICE,
                           "--batches", "1,3", "--widths", "5"]) == 0
    table = capsys.readouterr().out
    assert "L0.attn_probs" in table and "PASS" in table and "recorded in" in table
    drafter = DSparkDrafter.load(ckpt, target)
    rng = np.random.default_rng(1)
    requests = []
    for n, temperature in ((40, 0.0), (7, 0.0), (25, 0.8)):
        h = History(drafter.history_tokens, drafter.window, drafter.feature)
        h.reset(rng.integers(0, 500, n).astype(np.int32), rng.standard_normal((n - 1, drafter.feature)).astype(np.float32))
        requests.append(DraftRequest(h, 5, temperature, seed=11))
    result = compare_workers(ckpt, target, requests, DEVICE, 5, env=worker_env(state))
    assert result["entries"] == 6 and result["drafted"] == 6
    assert result["identical"] == 6, result["drafts"]


def test_the_status_says_which_tiles_the_card_takes(tmp_path):
    ckpt, target = tiny_checkpoint(tmp_path)
    described = NativeDSparkDrafter(DSparkDrafter.load(ckpt, target, device=DEVICE)).describe()
    assert described["kernels"] == "native"
    assert described["kernel_tiles"] == kernels.tiles_for(DEVICE).name in ("roomy", "compact")
