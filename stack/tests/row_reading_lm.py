"""A test drafter (loaded as 'row_reading_lm:drafter'): the target drafting for itself (most
drafts accepted) that also takes the target's hidden rows of ROW_READING_LAYERS (default 1),
as DeepSeek's drafter does, so an engine sends rows and turns on vLLM's hidden-state outputs."""

import json
import os

from remote_drafter.models.registry import load_drafter

LAYERS = tuple(int(x) for x in os.environ.get("ROW_READING_LAYERS", "1").split(","))


def drafter(target, device, **options):
    d = load_drafter("lm", target, device, **options)
    with open(os.path.join(target, "config.json")) as f:
        hidden = int(json.load(f)["hidden_size"])
    d.hidden_layers, d.feature, d.window = LAYERS, hidden * len(LAYERS), 64
    return d
