"""The gate on a tiny drafter, on the CPU: the bf16 fast path (autocast, fused loss; the
compiled variant runs in benchmarks/gpu.sh) passes against the float32 reference on fresh
inputs, and each injected error makes it fail, naming the quantity."""

import copy
import math
import os

import numpy as np
import pytest
import torch
from native_support import LAYERS, tiny_batch

from native_drafter import comparison
from native_drafter.fast import TOLERANCES, FastPath, fused_loss, training_gate
from native_drafter.objective import Objective, draft_logits, reference_loss
from native_drafter.train import TrainConfig, train


def failing(report, prefix):
    return [c.name for c in report.checks if not c.passed and c.name.split("/", 1)[1].startswith(prefix)]


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_path_passes_on_fresh_batches(tiny_target, tiny_drafter, seed):
    report = training_gate(tiny_drafter, [tiny_batch(tiny_target, seed)], FastPath(compile=False))
    assert report.passed, report.table(("batch0/loss", "batch0/logits", "batch0/grad/"))
    grads = [c for c in report.checks if "/grad/" in c.name]
    assert len(grads) == len(list(tiny_drafter.parameters()))
    assert all(0 < c.error < TOLERANCES["grad/"] for c in grads)  # bf16 really ran: errors > 0


def test_fused_loss_is_the_reference_loss_in_float64():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5, 50, generator=g, dtype=torch.float64) * 3
    teacher = torch.randn(7, 5, 50, generator=g, dtype=torch.float64) * 3
    obj = Objective()
    w = obj.position_weights(5).double()
    p_d, p_t = torch.softmax(logits, -1), torch.softmax(teacher, -1)
    tv = 0.5 * (p_d - p_t).abs().sum(-1)
    ce = -torch.log(p_d.gather(-1, p_t.argmax(-1, keepdim=True))).squeeze(-1)
    expected = ((0.1 * ce + 0.9 * tv) * w).sum(-1).mean() / w.sum()
    assert torch.allclose(fused_loss(logits, teacher, w, obj), expected, rtol=1e-12)
    assert math.isclose(float(w[1] / w[0]), math.exp(-1 / 4), rel_tol=1e-6)


def test_a_wrong_position_weight_fails_the_loss(tiny_target, tiny_drafter):
    fast = FastPath(objective=Objective(gamma=2.0), compile=False)
    report = training_gate(tiny_drafter, [tiny_batch(tiny_target, 0)], fast)
    assert not report.passed and "batch0/loss" in [c.name for c in report.checks if not c.passed]


def test_a_dropped_markov_term_fails_the_logits(tiny_target, tiny_drafter, monkeypatch):
    import native_drafter.fast as fast_mod

    def no_markov(model, batch):
        return model.block_logits(batch.ctx, batch.ctx_valid, batch.ctx_pos, batch.anchor, batch.anchor_pos)

    monkeypatch.setattr(fast_mod, "draft_logits", no_markov)
    report = training_gate(tiny_drafter, [tiny_batch(tiny_target, 0)], FastPath(compile=False))
    # at initialisation the Markov term is small next to z, so the logits barely move; the
    # head's gradients (zero without the term) are what give the missing term away
    assert failing(report, "grad/") == ["batch0/grad/markov.w1.weight", "batch0/grad/markov.w2.weight"]


def test_a_gradient_off_by_ten_percent_fails_that_gradient(tiny_target, tiny_drafter):
    class Skewed(FastPath):
        def loss(self, model, batch):
            model.layers[1].mlp.up_proj.weight.register_hook(lambda g: g * 1.10)
            return super().loss(model, batch)

    report = training_gate(tiny_drafter, [tiny_batch(tiny_target, 0)], Skewed(compile=False))
    assert failing(report, "grad/") == ["batch0/grad/layers.1.mlp.up_proj.weight"]


def test_non_finite_missing_unstated_and_misshaped_fail():
    ref = {"loss": torch.tensor(1.0), "logits": torch.ones(3), "grad/w": torch.ones(2)}
    bad = comparison.compare(ref, {"loss": torch.tensor(float("nan")), "logits": torch.ones(4)}, TOLERANCES)
    why = {c.name: c.why for c in bad.checks}
    assert not bad.passed
    assert "non-finite" in why["loss"] and "shape" in why["logits"] and "missing" in why["grad/w"]
    unstated = comparison.compare({"other": torch.ones(1)}, {"other": torch.ones(1)}, TOLERANCES)
    assert not unstated.passed and "no tolerance" in unstated.checks[0].why
    assert not comparison.GateReport([]).passed  # nothing checked is not a pass
    with pytest.raises(comparison.GateFailed, match="loss"):
        bad.raise_for_failure()


def test_relative_error_and_tolerance_lookup():
    a = torch.tensor([1.0, 2.0, 2.0])
    assert comparison.relative_error(a * 1.01, a)[0] == pytest.approx(0.01, rel=1e-6)
    assert comparison.tolerance_for("grad/markov.w1.weight", {"grad/": 1.0, "grad/markov": 2.0}) == 2.0
    assert comparison.tolerance_for("loss", {"grad/": 1.0}) is None


def test_a_failed_gate_writes_no_checkpoint(tiny_target, tmp_path):
    """train() with a broken fast path stops before the first step: gate report, no checkpoint."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, 4000).astype(np.uint16)
    offsets = np.arange(0, 4001, 200)
    cfg = TrainConfig(rows=4, length=64, anchors=64, gate_anchors=32, gate_batches=1, compile=False,
                      max_steps=2, target_layers=LAYERS)
    broken = FastPath(objective=Objective(ce_weight=0.2), compile=False)
    with pytest.raises(comparison.GateFailed):
        train(tiny_target, tokens, offsets, tokens, offsets, cfg, str(tmp_path),
              {"target_digest": "t", "tokenizer_digest": "k"}, {}, device="cpu", fast=broken)
    assert os.listdir(tmp_path) == ["gate-before.json"]


def test_reference_loss_is_zero_tv_when_the_drafter_is_the_teacher(tiny_target, tiny_drafter):
    """With teacher logits set to the drafter's own, TV = 0 and the loss is 0.1 x CE of its argmax."""
    batch = tiny_batch(tiny_target, 0)
    with torch.no_grad():
        batch.teacher = draft_logits(tiny_drafter, batch).clone()
        loss, logits = reference_loss(tiny_drafter, batch)
        lp = torch.log_softmax(logits, -1)
        ce = -lp.max(-1).values
        w = Objective().position_weights(5)
    assert loss.item() == pytest.approx((0.1 * ce * w).sum(-1).mean().item() / w.sum().item(), rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="GPU tier: no CUDA here; packages/native-drafter/benchmarks/gpu.sh stage runs it on an H200")
def test_compiled_fast_path_passes_on_cuda(tiny_target, tiny_drafter):
    target, drafter = copy.deepcopy(tiny_target).cuda(), copy.deepcopy(tiny_drafter).cuda()
    batch = tiny_batch(target, 0)
    report = training_gate(drafter, [batch], FastPath(compile=True))
    assert report.passed, report.table(("batch0/loss", "batch0/logits", "batch0/grad/"))
