"""The kernels' gate fails on each kind of injected error (a wrong stage value, an
unwritten output, a wrong draft token, an unwritten token, a tolerance exceeded, a stage
left out), passes the real kernels, and its pass record gates the worker's native back end."""

import json

import pytest
import torch
from native_kernel_support import DEVICE, tiny_checkpoint, tiny_model

from native_drafter import passes
from native_drafter.backend import load_native
from native_drafter.comparison import GateReport
from native_drafter.kernel_gate import TOLERANCES, Case, random_inputs, run_case, stage_table
from native_drafter.native import NativeRound


def case(seed=0):
    model = tiny_model(seed).to(DEVICE)
    return Case("tiny", model, random_inputs(model.config, 3, torch.Generator().manual_seed(seed)))


def broken(after_run):
    """A NativeRound whose run() is followed by `after_run(workspace)`."""
    class Broken(NativeRound):
        def run(self, ws):
            out = super().run(ws)
            after_run(ws)
            return out
    return Broken


def failed(report: GateReport) -> dict:
    return {c.name.split("/", 1)[1]: c.why for c in report.checks if not c.passed}


def test_the_real_kernels_pass():
    report = run_case(case(), DEVICE)
    assert report.passed and not failed(report)
    assert "ok" in stage_table(report, 2) and "PASS" in stage_table(report, 2)


def test_a_wrong_stage_value_fails_that_stage():
    def bump(ws):
        ws.bufs["L1.attn"][2, 7] += 1.0
    bad = failed(run_case(case(), DEVICE, broken(bump)))
    assert list(bad) == ["L1.attn"] and "the tolerance" in bad["L1.attn"]


def test_an_unwritten_output_fails_as_non_finite():
    class SkipsDown(NativeRound):  # never writes the last layer's output: the poison stays
        def run(self, ws):
            real = self.layers[-1]["wd"]
            from native_drafter import kernels
            linear = kernels.linear
            kernels.linear = lambda x, w, y, **kw: y if w is real else linear(x, w, y, **kw)
            try:
                return super().run(ws)
            finally:
                kernels.linear = linear
    bad = failed(run_case(case(), DEVICE, SkipsDown))
    assert "non-finite" in bad["L1.out"]
    assert "draft.tokens" in bad  # NaN logits give no valid token


def test_a_wrong_draft_token_fails_with_the_top2_gap():
    def flip(ws):
        ws.tokens[1, 2] = (ws.tokens[1, 2] + 1) % 512
    bad = failed(run_case(case(), DEVICE, broken(flip)))
    assert list(bad) == ["draft.tokens"] and "top-2 logit gap" in bad["draft.tokens"]


def test_an_unwritten_token_fails():
    def forget(ws):
        ws.tokens[0, 4] = -1
    bad = failed(run_case(case(), DEVICE, broken(forget)))
    assert "unwritten" in bad["draft.tokens"]


def test_a_small_error_fails_only_past_its_tolerance():
    def scale(ws):
        ws.bufs["ctx"].mul_(1 + 3e-4)  # relative error 3e-4: over ctx's 2e-5
    bad = failed(run_case(case(), DEVICE, broken(scale)))
    assert list(bad) == ["ctx"]
    loose = {**TOLERANCES, "ctx": 1e-3}
    assert run_case(case(), DEVICE, broken(scale), tolerances=loose).passed


def test_a_stage_left_out_fails():
    class NoProbs(NativeRound):
        def workspace(self, batch, width=None, probs=False):
            return super().workspace(batch, width, probs=False)
    bad = failed(run_case(case(), DEVICE, NoProbs))
    assert set(bad) == {"L0.attn_probs", "L1.attn_probs"} and all("missing" in w for w in bad.values())


def test_the_worker_back_end_needs_a_recorded_pass(tmp_path):
    from remote_drafter.models.dspark import DSparkDrafter
    ckpt, target = tiny_checkpoint(tmp_path)
    drafter = DSparkDrafter.load(ckpt, target, device=DEVICE)
    state = str(tmp_path / "state")
    with pytest.raises(passes.NotGated, match="no recorded gate pass"):
        load_native(drafter, DEVICE, state)
    passes.record(DEVICE, {"checks": 1}, state)
    assert load_native(drafter, DEVICE, state).describe()["kernels"] == "native"
    path = tmp_path / "state" / passes.FILE  # a pass recorded for other kernels does not count
    data = json.loads(path.read_text())
    path.write_text(json.dumps({k.replace(passes.kernel_digest(), "0" * 64): v for k, v in data.items()}))
    with pytest.raises(passes.NotGated):
        load_native(drafter, DEVICE, state)
