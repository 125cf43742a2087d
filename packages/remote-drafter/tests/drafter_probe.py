"""Test drafters that read the target's hidden rows. 'drafter_probe:row_recorder': prompt
lookup for its drafts, so vLLM accepts some and rejects others, and a record of every round's
hidden rows, so a test can compare them with the target's own hidden states at the same
positions (PROBE_DIR names the folder). 'drafter_probe:lm_reading_rows': the target drafting
for itself. PROBE_LAYERS: the target layers (default 3,29)."""

import itertools
import json
import os

import numpy as np

from remote_drafter.models.registry import load_drafter

LAYERS = tuple(int(x) for x in os.environ.get("PROBE_LAYERS", "3,29").split(","))


def reading_rows(drafter, target):
    """`drafter`, taking the target's hidden rows of LAYERS (a window of 64) as well."""
    with open(os.path.join(target, "config.json")) as f:
        hidden = int(json.load(f)["hidden_size"])
    drafter.hidden_layers, drafter.feature, drafter.window = LAYERS, hidden * len(LAYERS), 64
    return drafter


def lm_reading_rows(target, device, **options):
    """The target drafting for itself (most drafts accepted) and reading hidden rows."""
    return reading_rows(load_drafter("lm", target, device, **options), target)


def row_recorder(target, device, **options):
    """An n-gram drafter that also reads hidden rows (and writes them down)."""
    drafter = reading_rows(load_drafter("ngram", target, device, **options), target)
    rounds, folder, draft = itertools.count(), os.environ["PROBE_DIR"], drafter.draft

    def recording(requests, want_probs):
        for r in requests:
            h = r.history
            np.savez(os.path.join(folder, f"{next(rounds)}.npz"), tokens=h.tokens, rows=h.rows,
                     length=h.length)
        return draft(requests, want_probs)

    drafter.draft = recording
    return drafter
