"""The CLI end to end: init a drafter, print its identity, serve it, ask a worker for its
status, and run shadow parity against it (100% at greedy; refused for another drafter)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.testing import WorkerProcess  # noqa: E402


def cli(*args, check=True):
    return subprocess.run([sys.executable, "-m", "remote_drafter.cli", *args], capture_output=True,
                          text=True, check=check)


def test_init_identity_status_shadow(models, tmp_path):
    out = str(tmp_path / "drafter")
    text = cli("init", "--target", models["target"], "--out", out, "--target-layers", "0,2,3",
               "--window", "16").stdout
    assert "randomly initialised" in text
    manifest = json.loads(cli("identity", "--drafter", out, "--target", models["target"],
                              "--out", str(tmp_path / "m.json")).stdout)
    assert manifest["kind"] == "dspark" and json.load(open(tmp_path / "m.json")) == manifest
    worker = WorkerProcess(out, models["target"])
    try:
        status = json.loads(cli("status", "--worker", worker.address).stdout)
        assert status["manifest"] == manifest and status["open_requests"] == 0
        assert status["round_bytes_per_token"]["bfloat16"] == 4 + 3 * 64 * 2
        shadow = json.loads(cli("shadow", "--worker", worker.address, "--drafter", out, "--target",
                                models["target"], "--requests", "3", "--tokens", "24", "--json").stdout)
        assert shadow["fraction"] == 1.0 and shadow["rounds_compared"] > 0
        other = cli("shadow", "--worker", worker.address, "--drafter", models["dspark"], "--target",
                    models["target"], check=False)
        assert other.returncode == 2 and "another drafter" in other.stderr
    finally:
        worker.stop()


def test_a_bfloat16_worker_casts_its_checkpoint_and_says_so(models):
    worker = WorkerProcess(models["dspark"], models["target"], "tcp", 0, "--dtype", "bfloat16")
    try:
        shadow = cli("shadow", "--worker", worker.address, "--drafter", models["dspark"], "--target",
                     models["target"], "--requests", "2", "--tokens", "8", "--json", check=False)
        assert "the worker runs bfloat16 weights" in shadow.stderr, shadow.stderr
        assert json.loads(shadow.stdout)["rounds_compared"] > 0
    finally:
        worker.stop()


def test_env_lists_every_variable():
    text = cli("env").stdout
    for name in ("REMOTE_DRAFTER_ADDRESS", "REMOTE_DRAFTER_CAPACITY_MODE", "REMOTE_DRAFTER_DEPTH"):
        assert name in text


def test_worker_refuses_a_cache_it_cannot_keep_exact(models):
    p = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker", "--drafter", models["dspark"],
                        "--target", models["target"], "--listen", "127.0.0.1:0", "--spec-cache"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "tokens alone" in p.stderr
