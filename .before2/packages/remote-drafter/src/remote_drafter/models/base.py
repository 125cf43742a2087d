"""The drafter interface every back end implements (one small class per method, as vLLM's
proposers): a round is a list of DraftRequests in, one Draft per request out. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remote_drafter.engine.history import History
from remote_drafter.engine.identity import Manifest
from remote_drafter.engine.rows import dtype_of


@dataclass
class DraftRequest:
    history: History
    depth: int              # drafts wanted (<= the drafter's max_depth)
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Draft:
    tokens: np.ndarray       # int32 [depth]
    probs: np.ndarray | None  # float32 [depth, vocab]: what each token was drawn from
    own_probs: np.ndarray    # float32 [depth]: the drafter's probability of its token
    alt_tokens: np.ndarray   # int32 [depth]: its likeliest other token at each position
    alt_probs: np.ndarray    # float32 [depth]
    confidence: np.ndarray | None = None  # float32 [depth]: its estimate each is accepted


class Drafter:
    """A back end. Subclasses set these and implement draft()."""

    kind = "base"
    vocab_size: int
    feature: int = 0         # width of one hidden row it consumes; 0 = token-only
    max_depth: int = 8
    window: int = 128        # hidden rows it looks at (and keeps per request)
    history_tokens: int = 4096
    hidden_layers: tuple = ()  # target layers whose hidden rows it consumes, in order

    def manifest(self) -> Manifest:
        raise NotImplementedError

    def draft(self, requests: list[DraftRequest], want_probs: bool) -> list[Draft]:
        raise NotImplementedError

    def new_history(self) -> History:
        """Rows kept in the type the drafter computes in, which the engine sends them in."""
        return History(self.history_tokens, self.window, self.feature, dtype_of(self.dtype))

    @property
    def dtype(self) -> str:
        """The weights' dtype ("none": no model), which changes drafts near ties."""
        model = getattr(self, "model", None)
        return str(next(model.parameters()).dtype).removeprefix("torch.") if model is not None else "none"

    def describe(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "feature": self.feature,
                "max_depth": self.max_depth, "window": self.window,
                "history_tokens": self.history_tokens, "dtype": self.dtype,
                "hidden_layers": list(self.hidden_layers),
                **getattr(self, "serving_notes", {})}  # what the worker adds: its EXL3 gate state
