"""Runs against the scripted fake server: timings, token counts, salting, counters,
failures per request, the gate's exit code and compare's table."""

import json

import pytest
from fake_server import FakeServer, Script

from longctx_bench.cli import main


@pytest.fixture
def fake():
    srv = FakeServer(Script(ttft_s=0.08, gaps_s=(0.03, 0.03, 0.03, 0.03)))
    yield srv
    srv.stop()


def run_cli(fake, tmp_path, *extra, name="r.json"):
    code = main(["run", "--base-url", fake.url, "--model", "fake-model", "--contexts", "64,128",
                 "--max-concurrency", "1,2", "--repeats", "2", "--output-len", "8",
                 "--save-result", "--result-dir", str(tmp_path), "--result-filename", name,
                 "--hardware", "test-vm", *extra])
    path = tmp_path / name
    return code, (json.loads(path.read_text()) if path.exists() else None)


def test_run_measures_every_cell(fake, tmp_path):
    code, res = run_cli(fake, tmp_path, "--label", "A", "--plot")
    assert code == 0 and not res["partial"]
    assert [(c["context"], c["concurrency"]) for c in res["cells"]] == [
        (64, 1), (64, 2), (128, 1), (128, 2)]
    for c in res["cells"]:
        assert c["ttft_s"]["n"] == 2 * c["concurrency"]
        # bounds the server's sleeps guarantee on any machine (a busy client may read two
        # events as one, so no bound on a step): no token before its 80 ms, and the last
        # not before its four 30 ms gaps after that (test_metrics.py checks the definitions)
        assert c["ttft_s"]["mean"] >= 0.08 and c["task_s"]["mean"] >= 0.08 + 4 * 0.03
        assert c["step_p50_s"]["n"] == c["ttft_s"]["n"]
        assert c["tokens_per_event"]["mean"] == pytest.approx(8 / 5)
        assert not c["errors"] and not c["checks"]
        # cold: every request carries a fresh salt, so no cached prefix
        assert all(x == 0 for x in c["cached_tokens"])
        assert len(c["prompt_sha256"]) == 2 * c["concurrency"]
        sd = c["spec_decode"]
        # each completion adds 4 drafts and 6 accepted; the warm-up request lands before
        # the first scrape, so the cell counts exactly its own requests
        assert sd["num_drafts"] == 4 * 2 * c["concurrency"]
        assert sd["mean_accepted_length"] == pytest.approx(1 + 6 / 4)
        assert c["kv_capacity_tokens"] == 16_000
        p = c["percentiles"]
        assert set(p) == {"ttft_s", "step_p50_s"} and set(p["ttft_s"]) == {"p50", "p99"}
        assert p["ttft_s"]["p50"] <= p["ttft_s"]["p99"]
    # prompts are token ids of exactly the context length
    ctx = [len(r["prompt"]) for r in fake.requests if r["max_tokens"] == 8]
    assert set(ctx) == {64, 128}
    assert res["fingerprint"]["all"] and res["receipt"]["hardware"] == "test-vm"
    assert res["server_models"]["data"][0]["id"] == "fake-model"
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_warm_runs_resend_the_same_prompt(fake, tmp_path):
    code, res = run_cli(fake, tmp_path, "--warm")
    assert code == 0
    for c in res["cells"]:
        assert len(c["prompt_sha256"]) == 1
        assert all(x and x > 0 for x in c["cached_tokens"])


def test_failures_are_recorded_per_request(fake, tmp_path):
    # order of completions: fingerprint (3), then per cell a warm-up and the groups
    fake.behaviors.extend(["ok"] * 3 + ["ok", "malformed", "drop"] + ["ok", "http500"])
    code, res = run_cli(fake, tmp_path)
    assert code == 1  # the first cell had no request answered: the run says so, and goes on
    first = res["cells"][0]["errors"] + res["cells"][1]["errors"]
    assert any("malformed SSE" in e for e in first)
    assert any("HTTP 500" in e for e in first)
    assert any("peer closed connection" in e for e in first)
    assert len(first) == 3  # the rest of the run went on
    assert res["cells"][-1]["ttft_s"]["n"] == 4


def test_gate_and_compare(fake, tmp_path, capsys):
    code, base = run_cli(fake, tmp_path, "--label", "base", name="base.json")
    assert code == 0
    fake.script.gaps_s = (0.09,) * 4  # slower steps: a regression
    code, _ = run_cli(fake, tmp_path, "--label", "slow", "--baseline",
                      str(tmp_path / "base.json"), "--tolerance", "5%", name="slow.json")
    assert code == 3
    out = capsys.readouterr()
    assert "REGRESSION" in out.out + out.err
    assert main(["compare", str(tmp_path / "base.json"), str(tmp_path / "slow.json")]) == 0
    table = capsys.readouterr().out
    assert "step p50" in table and "base" in table and "slow" in table and "B / A" in table
    assert "greedy outputs: identical" in table
    # a gate across other hardware is refused
    other = json.loads((tmp_path / "slow.json").read_text())
    other["receipt"]["hardware"] = "h200"
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["compare", str(tmp_path / "other.json"), "--baseline",
                 str(tmp_path / "base.json")]) == 1


def test_capacity_drill(fake, tmp_path):
    code = main(["run", "--base-url", fake.url, "--model", "fake-model", "--contexts", "64",
                 "--repeats", "1", "--output-len", "4", "--capacity-drill", "3", "256",
                 "--save-result", "--result-dir", str(tmp_path), "--result-filename", "d.json"])
    d = json.loads((tmp_path / "d.json").read_text())["capacity_drill"]
    assert code == 0 and d["requests"] == 3 and d["all_completed"]
    assert all(r["completed"] and r["task_s"] > 0 for r in d["per_request"])


def test_tables_keep_every_digit_in_a_log(fake, tmp_path, capsys):
    """Piped to a file or a CI log the table is as wide as it needs: no number is cut to
    an ellipsis (rich's 80 columns did: `733…`)."""
    code, res = run_cli(fake, tmp_path, "--label", "A")
    assert code == 0
    out = capsys.readouterr().out
    assert "…" not in out, out
    cell = res["cells"][-1]
    assert f"{cell['ttft_s']['mean'] * 1e3:.2f}±{cell['ttft_s']['sd'] * 1e3:.2f}" in out


def test_a_run_in_which_nothing_was_answered_is_a_failure_not_a_result(fake, tmp_path, capsys):
    """Every completion failing: the fingerprint is of errors, not of outputs, and a cell with
    no answered request measures nothing; the run exits 1 saying so, compare does not call
    such fingerprints identical, and the gate counts the unmeasured cells as regressions."""
    code, base = run_cli(fake, tmp_path, "--label", "base", name="base.json")
    assert code == 0
    fake.behaviors.extend(["http500"] * 200)
    code, dead = run_cli(fake, tmp_path, "--label", "dead", name="dead.json")
    err = capsys.readouterr().err
    assert code == 1 and "FAILED cell 64 x 1: no request answered" in err
    assert "FAILED greedy fingerprint: 3 prompts not answered (HTTP 500" in err
    assert main(["compare", str(tmp_path / "dead.json"), str(tmp_path / "dead.json")]) == 0
    assert "greedy outputs: UNKNOWN: prompts not answered" in capsys.readouterr().out
    fake.behaviors.clear()
    fake.behaviors.extend(["http500"] * 200)
    code, _ = run_cli(fake, tmp_path, "--baseline", str(tmp_path / "base.json"), name="dead2.json")
    assert code == 3 and "not measured (2 errors) vs baseline" in capsys.readouterr().err


def test_mistakes_are_one_line_and_checked_before_measuring(fake, tmp_path, capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = "http://127.0.0.1:%d" % s.getsockname()[1]
    assert main(["run", "--base-url", nobody, "--model", "m", "--contexts", "64"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"longctx-bench run: {nobody}/v1/models: ") and "is the server up" in err
    before = len(fake.requests)
    for bad in (["--tolerance", "abc"], ["--baseline", str(tmp_path / "missing.json")], ["--contexts", "abc"]):
        assert main(["run", "--base-url", fake.url, "--model", "fake-model", *bad]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("longctx-bench run: ") and "\n" not in err, err
    assert len(fake.requests) == before  # nothing was measured
    assert main(["compare", str(tmp_path / "missing.json")]) == 1
    assert "No such file or directory" in capsys.readouterr().err


def test_the_gate_flags_an_unmeasured_cell_only_when_nothing_was_answered():
    """A metric a clean cell cannot have (step p50 of requests answered in one event each) is
    no regression; a cell the baseline measured and this run answered nothing in is."""
    from longctx_bench.compare import GATED, gate
    receipt = {"hardware": "h", "settings": {}}

    def cell(n, **means):
        return {"context": 64, "concurrency": 1, "mode": "cold", "errors": [] if n else ["HTTP 500"],
                "ttft_s": {"mean": means.get("ttft_s"), "n": n},
                **{m: {"mean": means.get(m)} for m in GATED if m != "ttft_s"}}
    base = {"receipt": receipt, "cells": [cell(2, ttft_s=0.1, step_p50_s=0.02, task_s=1.0)]}
    one_event = {"receipt": receipt, "cells": [cell(2, ttft_s=0.1, task_s=1.0)]}  # no step p50
    assert gate(one_event, base, 0.05) == []
    dead = {"receipt": receipt, "cells": [cell(0)]}
    assert any("not measured (1 errors)" in p for p in gate(dead, base, 0.05))
    interrupted = {"receipt": receipt, "cells": []}
    assert gate(interrupted, base, 0.05) == ["(64, 1, 'cold'): not measured in this run (interrupted?)"]


def test_free_port_never_hands_out_a_port_twice():
    """Nothing binds a port between free_port and its server's start, so two calls (servers
    started together) must not share one; span=2 keeps the next port out of later answers."""
    from longctx_bench.launch import free_port
    first = free_port(span=2)
    others = [free_port() for _ in range(300)]
    assert len(set(others)) == len(others) and not {first, first + 1} & set(others)
