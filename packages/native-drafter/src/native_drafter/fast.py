"""The training fast path, and the gate that holds it to the reference math.

Fast: matrix work in bfloat16 (autocast; the weights and the optimiser stay float32), the
loss rewritten for fusion (TV = 1 - sum min(p_d, p_t), CE = logsumexp - logit: one softmax
per side, reductions that torch.compile fuses into a few kernels), the whole forward and
loss compiled, and large anchor batches. Different arithmetic, same function: the gate
measures how far apart they are on fixed batches before any training step is taken.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from remote_drafter.models.dspark import DSparkModel

from .comparison import GateReport, compare, merge
from .objective import Batch, Objective, draft_logits, reference_loss

# Relative-error tolerances per quantity (bf16 operands: ~1e-3..1e-2 per product, and the
# drafter chains a projection, three layers, the head and a softmax). What the CPU and the
# H200 measure is in findings/drafter-training.md, well inside these; a wrong weight, a dropped term or a gradient off by a few
# percent lands far outside (tests/test_training_gate.py).
TOLERANCES = {
    "loss": 5e-3,
    "logits": 2e-2,
    "grad/": 5e-2,
}


def fused_loss(logits: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,
               objective: Objective) -> torch.Tensor:
    """The reference loss, rearranged for fusion."""
    lse = torch.logsumexp(logits, -1, keepdim=True)
    p_draft = torch.exp(logits - lse)
    p_target = torch.softmax(teacher.float(), -1)
    tv = 1.0 - torch.minimum(p_draft, p_target).sum(-1)   # = 1/2 ||p_d - p_t||_1
    best = teacher.argmax(-1, keepdim=True)               # argmax of logits = of softmax
    ce = (lse - logits.gather(-1, best)).squeeze(-1)
    per_position = objective.ce_weight * ce + objective.tv_weight * tv
    return (per_position * weights).sum(-1).mean() / weights.sum()


def _forward(model: DSparkModel, batch: Batch, objective: Objective, dtype: torch.dtype):
    with torch.autocast(batch.anchor.device.type, dtype=dtype):
        logits = draft_logits(model, batch).float()
    weights = objective.position_weights(logits.shape[1], logits.device)
    return fused_loss(logits, batch.teacher, weights, objective), logits


@dataclass
class FastPath:
    objective: Objective = field(default_factory=Objective)
    dtype: torch.dtype = torch.bfloat16
    compile: bool = True

    def __post_init__(self):
        self._fn = torch.compile(_forward, dynamic=False) if self.compile else _forward

    def loss(self, model: DSparkModel, batch: Batch):
        """(loss, draft logits [B, W, V] float32)."""
        return self._fn(model, batch, self.objective, self.dtype)


def quantities(loss_fn, model: DSparkModel, batch: Batch) -> dict[str, torch.Tensor]:
    """loss, logits and every parameter's gradient of one step (on a copy of `model`)."""
    m = copy.deepcopy(model)
    m.zero_grad(set_to_none=True)
    loss, logits = loss_fn(m, batch)
    loss.backward()
    out = {"loss": loss.detach(), "logits": logits.detach()}
    for name, p in m.named_parameters():
        out[f"grad/{name}"] = p.grad if p.grad is not None else torch.zeros_like(p)
    return out


def training_gate(model: DSparkModel, batches: list[Batch], fast: FastPath,
                  objective: Objective | None = None,
                  tolerances: dict[str, float] = TOLERANCES) -> GateReport:
    """Fast path vs float32 reference on each fixed batch: loss, logits, every gradient.
    The reference runs with TF32 off, so it is float32 arithmetic on any device."""
    objective = objective or Objective()
    reports = []
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    for i, batch in enumerate(batches):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            ref = quantities(lambda m, b: reference_loss(m, b, objective), model, batch)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        got = quantities(fast.loss, model, batch)
        reports.append(compare(ref, got, tolerances, label=f"batch{i}/"))
    return merge(reports)
