"""Shared helpers of native-drafter's tests (a unique module name: every package's tests
run in one pytest session)."""

import torch

from native_drafter.objective import anchors, make_batch
from native_drafter.teacher import teacher_forward

LAYERS = (0, 1, 3)


def tiny_batch(target, seed: int):
    """Fresh random token rows through the teacher, every anchor of them."""
    g = torch.Generator().manual_seed(seed)
    device = next(target.parameters()).device
    tokens = torch.randint(0, 512, (3, 40), generator=g).to(device)
    lengths = torch.tensor([40, 31, 12])
    logits, hidden = teacher_forward(target, tokens, LAYERS)
    rows, starts = anchors(lengths, 5)
    return make_batch(tokens, logits, hidden, rows.to(device), starts.to(device), 16, 5)
