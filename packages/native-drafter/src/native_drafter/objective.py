"""The reference training math, float32, no fusion, written to be read.

A training example is one *anchor*: a committed position t of a text. At inference the
drafter gets the target's hidden rows of the `window` positions before t (the rows of
layers config.target_layers), the anchor token x_t, and proposes x_{t+1} .. x_{t+W}:

    z_1..z_W = DSparkModel.block_logits(context rows, anchor)         (one parallel pass)
    logits_i = z_i + Markov(x_{t+i-1})                                 (x_t = the anchor)

Teacher forcing: x_{t+i-1} for i > 1 is the text's token, and the teacher's distribution
for draft i is the target's next-token distribution at position t+i-1 on the same text,
p_t(. | x_{<=t+i-1}). The loss (DSpark's public config, ARCHITECTURE.md § DSpark drafter):

    loss = sum_i w_i (0.1 CE_i + 0.9 TV_i) / sum_i w_i, averaged over anchors,
    w_i  = exp(-(i-1)/gamma), gamma = 4        (early drafts count more: they gate the rest)
    TV_i = 1/2 || p_d,i - p_t,i ||_1            (total variation to the target's distribution)
    CE_i = -log p_d,i(argmax p_t,i)             (cross-entropy to the target's own token)

The Markov head is trained by the same loss through logits_i (it is what makes draft i
depend on draft i-1); the block positions enter through w_i and through z_i's slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remote_drafter.models.dspark import DSparkModel


@dataclass(frozen=True)
class Objective:
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    gamma: float = 4.0

    def position_weights(self, block: int, device=None) -> torch.Tensor:
        """w_i = exp(-(i-1)/gamma), i = 1..W."""
        return torch.exp(-torch.arange(block, dtype=torch.float32, device=device) / self.gamma)


@dataclass
class Batch:
    """B anchors, each with everything one drafting round sees, and the teacher's answer."""
    ctx: torch.Tensor        # [B, C, F] target hidden rows of the C positions before the anchor
    ctx_valid: torch.Tensor  # [B, C] bool (False before the text's start)
    ctx_pos: torch.Tensor    # [B, C] their positions
    anchor: torch.Tensor     # [B] x_t
    anchor_pos: torch.Tensor  # [B] t
    previous: torch.Tensor   # [B, W] x_t .. x_{t+W-1}: the Markov head's input per draft
    teacher: torch.Tensor    # [B, W, V] target logits at t .. t+W-1 (for x_{t+1} .. x_{t+W})

    def __len__(self) -> int:
        return self.anchor.shape[0]


def make_batch(tokens: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor,
               rows: torch.Tensor, starts: torch.Tensor, window: int, block: int) -> Batch:
    """Anchors (rows[b], starts[b]) of teacher outputs for token rows: tokens [S, L], logits
    [S, L, V], hidden [S, L, F]. The context window is right-aligned and zero where it runs
    before the text, exactly as DSparkDrafter._context lays it out at inference."""
    offsets = torch.arange(-window, 0, device=tokens.device)
    ctx_pos = starts[:, None] + offsets                       # [B, C]
    valid = ctx_pos >= 0
    ctx = hidden[rows[:, None], ctx_pos.clamp(min=0)] * valid[..., None]
    ahead = starts[:, None] + torch.arange(block, device=tokens.device)  # t .. t+W-1
    return Batch(ctx=ctx, ctx_valid=valid, ctx_pos=ctx_pos * valid, anchor=tokens[rows, starts],
                 anchor_pos=starts, previous=tokens[rows[:, None], ahead],
                 teacher=logits[rows[:, None], ahead])


def anchors(lengths: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every anchor whose W teacher positions lie inside its row: t + W - 1 < length."""
    rows, starts = [], []
    for r, n in enumerate(lengths.tolist()):
        t = torch.arange(0, max(n - block + 1, 0))
        rows.append(torch.full_like(t, r))
        starts.append(t)
    return torch.cat(rows), torch.cat(starts)


def draft_logits(model: DSparkModel, batch: Batch) -> torch.Tensor:
    """logits_i = z_i + Markov(x_{t+i-1}) for i = 1..W: [B, W, V] float32."""
    z = model.block_logits(batch.ctx, batch.ctx_valid, batch.ctx_pos, batch.anchor, batch.anchor_pos)
    return z + model.markov(batch.previous)


def reference_loss(model: DSparkModel, batch: Batch, objective: Objective = Objective()):
    """(loss, draft logits [B, W, V]) in float32, one readable step at a time."""
    logits = draft_logits(model, batch).float()
    log_p_draft = torch.log_softmax(logits, dim=-1)
    p_draft = torch.exp(log_p_draft)
    p_target = torch.softmax(batch.teacher.float(), dim=-1)
    tv = 0.5 * (p_draft - p_target).abs().sum(-1)                       # [B, W]
    target_token = p_target.argmax(-1, keepdim=True)
    ce = -log_p_draft.gather(-1, target_token).squeeze(-1)              # [B, W]
    per_position = objective.ce_weight * ce + objective.tv_weight * tv
    w = objective.position_weights(logits.shape[1], logits.device)
    loss = (per_position * w).sum(-1).mean() / w.sum()
    return loss, logits
