"""The main job in the vLLM CPU tier (tools/test sets LONGCTX_VLLM_PYTHON; elsewhere skipped):
`dsv41-stack demo`, shortened, end to end — five engine launches over one offload host (an
Engram server and a drafter worker), the last over two with the first killed mid-run — with
the same greedy output everywhere, failover and no disk fallback in the fleet, the KV trade in vLLM's own
figures, and nothing left running."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from dsv41_stack.cli import main, template_path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]


def test_the_demo_runs_the_five_configurations(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # local.env's paths are relative to the repository
    delta = tmp_path / "here.env"
    delta.write_text(f"STACK_RUN_DIR={tmp_path}\nSTACK_MODEL={tmp_path}/model\n"
                     f"STACK_ENGRAM_SHARDS={tmp_path}/model/shards\nSTACK_VLLM_PYTHON={PYTHON}\n")
    code = main(["demo", "--env", str(template_path("local")), "--env", str(delta),
                 "--contexts", "256", "--repeats", "1", "--output-len", "16"])
    report = json.loads((tmp_path / "results" / "demo.json").read_text())
    print(capsys.readouterr().out[-1500:])
    assert code == 0 and report["identical_output"]
    rows = {r["config"]: r for r in report["configs"]}
    assert list(rows) == ["A", "B", "D", "D-async", "D-fleet"]
    assert all(r["errors"] == 0 and r["bench_exit"] == 0 for r in rows.values())
    assert rows["D-async"]["deferred_rounds"] > 0  # its drafts went into the next inputs
    fleet = rows["D-fleet"]  # the first offload host killed once it served rows of the run
    assert fleet["host0_killed_after_rows"] > 0 and fleet["engram_host_states"] == ["failed", "healthy"]
    assert fleet["engram_failovers"] >= 1 and fleet["engram_fallbacks"] == fleet["engram_local_rows"] == 0
    assert fleet["engram_rows_by_host"][1] > 0, fleet
    assert [w["role"] for w in fleet["drafter_workers"] if w["current"]] == ["standby"], fleet
    for r in rows.values():  # the robust figures: blocked time per step, the step spread
        assert r["blocked_p50_ms"] is not None and r["blocked_p50_ms"] >= 0, r
        assert r["step_p10_s"] <= r["step_p50_s"] <= r["step_p90_s"], r
    # what leaves the engine (tables from A to B, the drafter from B to D) becomes KV pool,
    # in vLLM's own count
    budget, tables, drafter = (report[k] for k in ("kv_budget_bytes", "engram_table_bytes",
                                                   "local_drafter_bytes"))
    assert drafter > 0  # the trained DSpark checkpoint, not prompt lookup
    assert [rows[c]["kv_budget_bytes"] for c in rows] == [
        budget - tables - drafter, budget - drafter, budget, budget, budget]
    assert rows["A"]["kv_tokens"] < rows["B"]["kv_tokens"] < rows["D"]["kv_tokens"] \
        == rows["D-async"]["kv_tokens"] == rows["D-fleet"]["kv_tokens"]
    assert all(r["accepted_length"] and r["accepted_length"] > 1 for r in rows.values())
    assert (tmp_path / "results" / "demo.png").stat().st_size > 1000
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert not left.stdout.strip(), f"processes left running: {left.stdout}"
