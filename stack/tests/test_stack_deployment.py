"""`up`, `canary`, `status`, `rollback`, `down` of the miniature in real vLLM (the vLLM CPU
tier; tools/test sets LONGCTX_VLLM_PYTHON, elsewhere skipped): configuration D-async comes
up in the reference order and records its canary, whose counters include the async
proxy's (rounds answered, none failed, no watchdog fire); each lever's rollback in turn (async,
remote Engram, remote drafter), applied by restarting the engine with the written env file,
keeps the fingerprint with fresh counters; the offload host stopped
under a serving engine leaves it serving the same output (Engram from disk, target-only
decoding) and status shows the degradation; nothing is left running."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from dsv41_stack.cli import main, template_path
from dsv41_stack.config import StackConfig
from dsv41_stack.deployment import Deployment
from longctx_bench.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]


def test_up_canary_rollbacks_and_a_lost_offload_host(tmp_path, monkeypatch, capsys):
    from remote_engram.vllm.build_miniature import build

    monkeypatch.chdir(ROOT)
    model = tmp_path / "model"
    build(str(model), str(ROOT / ".artifacts/smollm2-135m"), base=str(ROOT / ".artifacts/smollm2-135m"))
    here = tmp_path / "here.env"
    here.write_text(f"STACK_RUN_DIR={tmp_path}/run\nSTACK_MODEL={model}\nSTACK_VLLM_PYTHON={PYTHON}\n"
                    f"STACK_ENGRAM_SHARDS={model}/shards\nENGRAM_SHARD_DIR={model}/shards\n"
                    "VLLM_DSPARK_REMOTE_ASYNC=1\n"  # configuration D-async: every lever on
                    f"REMOTE_DRAFTER_METRICS_LISTEN=127.0.0.1:{free_port()}\n")  # status: the pool
    env = ["--env", str(template_path("local")), "--env", str(here)]
    try:
        assert main(["up", *env, "--record-canary"]) == 0
        capsys.readouterr()
        assert main(["canary", *env]) == 0
        out = capsys.readouterr().out  # the async proxy's counters, fresh over the canary
        assert "canary: async proxy ok: " in out and " 0 failed, 0 watchdog fires, 0 respawns" in out, out
        assert main(["status", *env]) == 0
        status = Deployment(StackConfig.load(env[1::2])).status()
        assert status["engine"]["counters"]["num_drafts"] > 0  # the remote drafter drafted
        handoff = status["engine"]["handoff"]  # ... through the proxy, read where it serves them
        assert handoff["rounds_ok"] > 0 and handoff["enabled"] == 1, handoff
        assert handoff["rounds_failed"] == handoff["watchdog_fires"] == handoff["respawns"] == 0, handoff
        assert status["engram-server"]["health"]["resident_bytes"] > 0
        host, = status["engine"]["engram_hosts"]  # the offload host as the engine's client sees it
        assert host["state"] == "healthy" and host["rows"] > 0, host
        worker, = status["engine"]["drafter_workers"]  # the pool: the primary alone here
        assert worker["current"] and worker["role"] == "primary", worker
        assert "error" not in status["drafter-worker"], status["drafter-worker"]
        for lever in ("async", "remote-engram", "remote-drafter"):
            rolled = tmp_path / f"{lever}.env"
            assert main(["rollback", lever, *env, "--write", str(rolled)]) == 0
            assert main(["down", *env, "--role", "engine"]) == 0
            assert main(["up", "--env", str(rolled), "--role", "engine"]) == 0  # canary inside
            out = capsys.readouterr().out
            assert "canary: output ok" in out and "canary: ok, counters fresh" in out, out
            assert "async proxy" not in out, out  # synchronous rounds from the first rollback on
            env = ["--env", str(rolled)]
        # drill: the offload host goes away under a serving engine (back on D-async)
        assert main(["down", "--env", str(template_path("local")), "--env", str(here),
                     "--role", "engine"]) == 0
        env = ["--env", str(template_path("local")), "--env", str(here)]
        assert main(["up", *env, "--role", "engine"]) == 0
        assert main(["down", *env, "--role", "offload-host"]) == 0
        capsys.readouterr()
        assert main(["canary", *env]) == 1  # same output (Engram from disk, no drafts) ...
        out = capsys.readouterr().out
        # no round answered through the proxy: no drafts, whatever placeholders vLLM counted
        assert "canary: output ok" in out and "DEGRADED: no drafts made; Engram fallbacks" in out, out
        assert main(["status", *env]) == 1  # ... and the degradation shows
        host, = Deployment(StackConfig.load(env[1::2])).status("engine")["engine"]["engram_hosts"]
        assert host["state"] == "failed" and host["reason"], host
        with __import__("urllib.request").request.urlopen("http://127.0.0.1:17495/metrics") as r:
            assert "engram_client_fallbacks_total" in r.read().decode()
    finally:
        main(["down", *env])
        main(["down", "--env", str(template_path("local")), "--env", str(here)])
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert not left.stdout.strip(), f"processes left running: {left.stdout}"
    assert json.loads((tmp_path / "run" / "canary-reference.json").read_text())["all"]
