"""The worker's native back end (`remote-drafter worker --kernels native`): the DSpark
drafter with its round on the native kernels. Same weights, same identity, same request
layout and the same token picking (remote_drafter's Picker: greedy or seeded draws, the
speculation cache's alternatives); only z and the Markov-corrected logits come from the
kernels. It refuses to exist unless the gate has passed for these kernels on this GPU.
The worker finds load_native by name: pyproject.toml registers it as `native` in the
remote_drafter.kernels entry-point group (remote_drafter never imports this package)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from remote_drafter.models.base import Drafter
from remote_drafter.models.dspark import DSparkDrafter
from remote_drafter.models.pick import Picker, split

from . import passes
from .native import NativeRound
from .staged_round import inputs_from_requests

WORKSPACES = 8  # batch sizes whose buffers are kept (least recently used dropped)


class NativeDSparkDrafter(DSparkDrafter):
    def __init__(self, base: DSparkDrafter):
        super().__init__(base.config, base.model, base.manifest(), base.device)
        self.round = NativeRound(base.model)
        self._spaces: OrderedDict[int, object] = OrderedDict()

    def describe(self) -> dict:
        return {**super().describe(), "kernels": "native", "kernel_tiles": self.round.tiles.name}

    def _workspace(self, batch: int):
        ws = self._spaces.pop(batch, None) or self.round.workspace(batch)
        self._spaces[batch] = ws
        while len(self._spaces) > WORKSPACES:
            self._spaces.popitem(last=False)
        return ws

    @torch.inference_mode()
    def draft(self, requests, want_probs: bool):
        ws = self._workspace(len(requests))
        ws.load(inputs_from_requests(self, requests).to(self.device))
        self.round.block_logits(ws)
        pick, previous = Picker(requests, want_probs), ws.in_anchor
        for i in range(max(r.depth for r in requests)):
            logits = self.round.correct(ws, i, previous)
            previous = pick(logits, [r.history.length + i for r in requests])
        return split(requests, *pick.finish())


def load_native(drafter: Drafter, device: str, state_dir: str | None = None) -> NativeDSparkDrafter:
    """`drafter` on the native kernels, or ValueError saying why not (another kind of
    drafter, other weights than float32, no recorded gate pass for this GPU)."""
    if not isinstance(drafter, DSparkDrafter):
        raise ValueError(f"--kernels native exists for DSpark checkpoints only, not the {drafter.kind} drafter")
    passes.require(device, state_dir)
    return NativeDSparkDrafter(drafter)
