"""Real drafter states for the gate and the worker check: round starts in validation text,
each as the worker holds it (the committed tokens, and the target's hidden rows of the
window before the newest token, from the trained drafter's target layers).

Made once on a machine with the target's folder (`native-drafter states`), carried to the
GPU machine (which has no target): rows are stored as bfloat16 to fit a device call; they
are inputs, so their rounding changes what is tested on, not how strictly.
"""

from __future__ import annotations

import numpy as np
import torch

from remote_drafter.engine.history import History
from remote_drafter.models.base import DraftRequest


def make_states(target, tokens: np.ndarray, offsets: np.ndarray, layers: tuple[int, ...],
                window: int, count: int, seed: int = 0) -> dict:
    """`count` round starts from distinct documents (seeded), each with at least `window`
    committed tokens before the anchor when the document allows."""
    rng = np.random.default_rng(seed)
    long_docs = [d for d in range(len(offsets) - 1) if offsets[d + 1] - offsets[d] > window + 16]
    picked = rng.choice(long_docs, size=count, replace=False)
    out = {"layers": list(layers), "window": window, "tokens": [], "rows": [], "docs": []}
    for d in picked:
        start, end = int(offsets[d]), int(offsets[d + 1])
        t = int(rng.integers(window // 2, min(end - start - 1, 3 * window)))  # anchor index in the doc
        prefix = torch.from_numpy(tokens[start:start + t + 1].astype(np.int64))
        _, hidden = target(prefix, layers)
        out["tokens"].append(prefix.to(torch.int32))
        out["rows"].append(hidden[:-1][-window:].to(torch.bfloat16))  # all but the newest
        out["docs"].append(int(d))
    return out


def requests_from(states: dict, drafter) -> list[DraftRequest]:
    """DraftRequests (greedy, full depth) holding the states as the worker's histories."""
    if list(states["layers"]) != list(drafter.hidden_layers):
        raise ValueError(f"states of target layers {states['layers']}, the drafter reads {list(drafter.hidden_layers)}")
    requests = []
    for tokens, rows in zip(states["tokens"], states["rows"]):
        h = History(drafter.history_tokens, drafter.window, drafter.feature)
        h.reset(tokens.numpy(), rows.float().numpy())
        requests.append(DraftRequest(h, drafter.max_depth))
    return requests
