"""A small causal LM drafting token by token from the committed tokens (token-only). With
the target's own checkpoint it is the target's copy: every draft is accepted at T = 0."""

from __future__ import annotations

import torch

from remote_drafter.engine.identity import Manifest, digest_tensors, target_digest, tokenizer_digest

from .base import Draft, Drafter, DraftRequest
from .llama import LlamaLM
from .pick import Picker, split


class LMDrafter(Drafter):
    kind = "lm"

    def __init__(self, model: LlamaLM, manifest: Manifest, device: str = "cpu",
                 max_depth: int = 8, history_tokens: int = 4096):
        self.model, self._manifest, self.device = model, manifest, device
        self.vocab_size, self.max_depth, self.history_tokens = model.config.vocab_size, max_depth, history_tokens
        self.window = 0

    @classmethod
    def from_folder(cls, folder: str, device: str = "cpu", **options) -> LMDrafter:
        model = LlamaLM.load(folder, device=device)
        digest = target_digest(folder)
        state = model.state_dict()
        manifest = Manifest(target=digest, tokenizer=tokenizer_digest(folder), kind=cls.kind,
                            drafter=digest_tensors((n, state[n].cpu().numpy().tobytes())
                                                   for n in sorted(state)))
        return cls(model, manifest, device, **options)

    def manifest(self) -> Manifest:
        return self._manifest

    @torch.inference_mode()
    def draft(self, requests: list[DraftRequest], want_probs: bool) -> list[Draft]:
        out = []
        for r in requests:  # one at a time: sequences differ in length
            pick = Picker([r], want_probs)
            seq = torch.tensor(r.history.tokens, dtype=torch.long, device=self.device)
            for i in range(r.depth):
                logits, _ = self.model(seq)
                token = pick(logits[-1:], [r.history.length + i])
                seq = torch.cat([seq, token])
            out += split([r], *pick.finish())
        return out
