"""The vLLM CPU tier (tools/test sets LONGCTX_VLLM_PYTHON; elsewhere skipped): a 32K-token
prompt with a hidden-state drafter in real vLLM. The engine copies, holds and sends one
window of the target's hidden rows per request, not the prompt's 32K (read from the
proposer's and the client's metrics), and greedy output equals target-only decoding. The
target is a tiny random Llama (two layers), so the 32K-token prefill takes seconds on a CPU."""

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from longctx_bench.launch import VllmServer, free_port
from remote_drafter.worker.server import spawn_worker

PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
SMOLLM2 = Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]
PROMPT_TOKENS, NEW_TOKENS, K = 32768, 16, 3
MAX_LEN = PROMPT_TOKENS + 1024
SPEC = json.dumps({"method": "custom_class", "model": "remote_drafter.vllm.RemoteProposer",
                   "num_speculative_tokens": K})


@pytest.fixture(scope="module")
def long_target(tmp_path_factory):
    """A random two-layer Llama with SmolLM2's tokenizer, positions for the long prompt."""
    from remote_drafter.models.llama import LlamaConfig, random_llama
    folder = tmp_path_factory.mktemp("long") / "target"
    random_llama(LlamaConfig(vocab_size=49152, hidden_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256)).save(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_LEN}))
    for name in [*SMOLLM2.glob("*token*"), SMOLLM2 / "generation_config.json"]:
        shutil.copy(name, folder)
    return folder


def prompt_ids() -> list[int]:
    """A 50-token phrase over and over (prompt lookup finds drafts in it)."""
    phrase = [(7919 * i) % 40000 + 100 for i in range(50)]
    return (phrase * (PROMPT_TOKENS // len(phrase) + 1))[:PROMPT_TOKENS]


def complete(server: VllmServer, ids: list[int]) -> dict:
    body = {"model": server.name, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0,
            "return_token_ids": True, "logprobs": 2}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]


def serve(target: Path, log: Path, spec: str | None = None, env: dict | None = None) -> VllmServer:
    return VllmServer(PYTHON, target, log, spec, env, kv_bytes=1 << 27, max_tokens=NEW_TOKENS,
                      max_model_len=MAX_LEN)


def test_a_32k_prompt_costs_the_engine_one_window_of_rows(long_target, tmp_path):
    ids = prompt_ids()
    server = serve(long_target, tmp_path / "target-only.log")
    try:
        want = complete(server, ids)
    finally:
        server.stop()
    rounds = tmp_path / "rounds"
    rounds.mkdir()
    tests = str(Path(__file__).parent)
    proc, address = spawn_worker(
        ["--drafter", "drafter_probe:row_recorder", "--target", str(long_target),
         "--listen", "127.0.0.1:0"],
        env={**os.environ, "PROBE_DIR": str(rounds), "PROBE_LAYERS": "1",
             "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])})
    listen = f"127.0.0.1:{free_port()}"
    server = serve(long_target, tmp_path / "drafted.log", SPEC, {
        "REMOTE_DRAFTER_ADDRESS": address, "REMOTE_DRAFTER_TARGET": str(long_target),
        "REMOTE_DRAFTER_DEADLINE_MS": "5000", "REMOTE_DRAFTER_METRICS_LISTEN": listen})
    try:
        got = complete(server, ids)
        with urllib.request.urlopen(f"http://{listen}/health", timeout=10) as r:
            health = json.loads(r.read())
    finally:
        server.stop()
        proc.kill()
        proc.wait()
    assert got["token_ids"] == want["token_ids"]
    window, feature = 64, 128  # the probe's window; one tapped layer of the 128-wide target
    proposer, client = health["proposer"], health["client"]
    print(json.dumps({"prompt_tokens": PROMPT_TOKENS, "window": window,
                      "rows_copied": proposer["hidden_rows_copied"],
                      "rows_held_peak": health["hidden_rows_held_peak"],
                      "rows_sent": client["rows_sent"], "row_bytes_sent": client["row_bytes_sent"],
                      "request_bytes": client["request_bytes"]}))
    assert client["rounds_ok"] > 0 and client["rows_sent"] > 0  # it drafted, from rows
    # held: the client's window to re-open from, and what the step since the last round added
    assert health["hidden_rows_held_peak"] <= window + K + 1, health
    # sent: the open's window, then a row per committed token
    assert client["rows_sent"] <= window + NEW_TOKENS + K, client
    assert client["row_bytes_sent"] == client["rows_sent"] * feature * 4  # float32 drafter
    # copied off the device: each prefill chunk's newest window at most, then the commits
    assert proposer["hidden_rows_copied"] < PROMPT_TOKENS // 8, proposer
