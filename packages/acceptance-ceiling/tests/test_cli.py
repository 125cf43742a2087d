"""The CLI: report on the demo pair and on a logprob file, measure, validate."""

import json

import numpy as np
import pytest

from acceptance_ceiling.cli import main


def test_report_measure_validate(tmp_path, capsys):
    rep = tmp_path / "r.json"
    assert main(["report", "--demo", "--k-max", "3", "--prompts", "20", "--out", str(rep),
                 "--plot", str(tmp_path / "r.png"), "--cost", "5,0.2,1,0.3,0.5"]) == 0
    r = json.loads(rep.read_text())
    k = r["classes"]["demo"]["k"]
    assert r["classes"]["demo"]["method"] == ["exact"]
    assert 1 < k["1"]["accepted_length"]["mean"] < k["3"]["accepted_length"]["mean"] < 4
    assert r["classes"]["demo"]["depth_table"]["batches"]["1"]["speedup"] > 1
    assert (tmp_path / "r.png").stat().st_size > 1000
    meas = tmp_path / "m.json"
    assert main(["measure", "--demo", "--k", "2", "--prompts", "10", "--new-tokens", "100",
                 "--out", str(meas)]) == 0
    assert json.loads(meas.read_text())["prediction_agrees"]
    # a longctx-bench result's spec-decode counters as the measurement
    lc = tmp_path / "lc.json"
    mean = k["2"]["accepted_length"]["mean"]
    lc.write_text(json.dumps({"cells": [{"spec_decode": {
        "num_drafts": 1000, "num_accepted_tokens": round((mean - 1) * 1000)}}]}))
    assert main(["validate", str(rep), str(lc), "--k", "2"]) == 0
    lc.write_text(json.dumps({"cells": [{"spec_decode": {"num_drafts": 10,
                                                         "num_accepted_tokens": 0}}]}))
    assert main(["validate", str(rep), str(lc), "--k", "2"]) == 1
    assert "OUTSIDE" in capsys.readouterr().out
    assert main(["validate", str(rep), str(meas), "--k", "2"]) in (0, 1)  # a measure: its own check said too
    assert "measure's exact prediction on its own round starts" in capsys.readouterr().out
    # usage errors: one line, exit 2 (1 means outside)
    for args, why in ((["validate", str(rep), str(meas), "--k", "3"], "was measured at k=2, not --k 3"),
                      (["validate", str(rep), str(lc), "--k", "9"], "predicts k = 1, 2, 3, not 9"),
                      (["validate", str(rep), str(lc), "--k", "2", "--cls", "code"], "no class 'code'"),
                      (["validate", str(tmp_path / "none.json"), str(lc), "--k", "2"], "No such file"),
                      (["report", "--demo", "--k-max", "1", "--prompts", "2", "--cost", "1,2,3"], "five numbers")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err


def test_logprob_file_report(tmp_path):
    lp = np.log
    prompts = [{"class": "code", "positions": [
        {"target": {"a": lp(0.9), "b": lp(0.1)}, "draft": {"a": lp(0.8), "c": lp(0.2)}}] * 4},
        {"class": "prose", "positions": [
            {"target": {"a": lp(0.5), "b": lp(0.5)}, "draft": {"c": lp(1.0)}}] * 4}]
    f = tmp_path / "lp.json"
    f.write_text(json.dumps(prompts))
    out = tmp_path / "r.json"
    assert main(["report", "--logprobs", str(f), "--k-max", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    code = r["classes"]["code"]["k"]
    assert code["1"]["accepted_length"]["mean"] == pytest.approx(1.8)         # 1 + 0.8
    assert code["2"]["accepted_length"]["mean"] == pytest.approx(1 + 0.8 + 0.64)
    assert r["classes"]["prose"]["k"]["2"]["accepted_length"]["mean"] == pytest.approx(1.0)
    assert "approximation" in r["classes"]["code"]["method"][0]
