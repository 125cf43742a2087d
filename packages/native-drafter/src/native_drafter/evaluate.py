"""Acceptance of a drafter for the miniature's target, two ways, at T = 0:

* exact (acceptance-ceiling's `exact`): at round starts sampled from validation documents,
  per class, the expected accepted drafts E_k for k = 1..5 along the drafter's own chain
  (the target runs on prefix + drafts). At T = 0 each round is deterministic, so the mean
  over round starts is exact for that set. Per position: reach_i = P(drafts 1..i all
  accepted) = mean(E_i - E_{i-1}); conditional acceptance = reach_i / reach_{i-1}.
* measured (remote_drafter.decode_loop.speculative_decode): the reference speculative loop
  decodes from validation prompts with drafts from the real DrafterClient; mean accepted
  length = 1 + accepted / rounds, and the per-position reach from the accepted counts.

Drafters: the trained DSpark checkpoint, the untrained one (same config, init seed 0) and
the n-gram drafter (prompt lookup).
"""

from __future__ import annotations

import numpy as np
import torch

from acceptance_ceiling.chain import exact
from acceptance_ceiling.dists import adjust
from remote_drafter.models.dspark import DSparkModel
from remote_drafter.models.llama import LlamaLM
from remote_drafter.models.ngram import NgramDrafter

from .corpus import CLASSES

K_MAX = 5


def round_starts(offsets: np.ndarray, classes: np.ndarray, per_class: int, seed: int,
                 min_context: int = 16, max_prefix: int = 320) -> list[tuple[int, str, int]]:
    """(document, class, anchor position t) per class, seeded: documents drawn at random
    (with replacement when a class has fewer), t uniform in [min_context, ...] so that W
    text tokens follow and the prefix stays under max_prefix tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for c, name in enumerate(CLASSES):
        docs = [d for d in np.flatnonzero(classes == c)
                if offsets[d + 1] - offsets[d] >= min_context + K_MAX + 2]
        if not docs:
            continue
        for d in rng.choice(docs, per_class, replace=len(docs) < per_class):
            n = int(offsets[d + 1] - offsets[d])
            t = int(rng.integers(min_context, min(n - K_MAX - 1, max_prefix)))
            out.append((int(d), name, t))
    return out


class TargetDists:
    """prefix -> the target's distribution at T = 0 (one-hot argmax), cached per prefix."""

    def __init__(self, target: LlamaLM):
        self.target, self.cache, self.calls = target, {}, 0
        self.device = next(target.parameters()).device

    def logits_hidden(self, prefix, layers):
        with torch.no_grad():
            return self.target(torch.tensor(list(prefix), device=self.device), tuple(layers))

    def remember(self, prefix, last_logits: torch.Tensor) -> None:
        self.cache[tuple(prefix)] = adjust(last_logits.double().cpu().numpy(), 0.0)

    def __call__(self, prefix) -> np.ndarray:
        key = tuple(prefix)
        if key not in self.cache:
            self.calls += 1
            logits, _ = self.logits_hidden(key, ())
            self.remember(key, logits[-1])
        return self.cache[key]


def dspark_chain(model: DSparkModel, hidden: torch.Tensor, prefix: list[int]):
    """The drafter's distribution callable for one round at prefix (anchor = prefix[-1]):
    hidden [t, F] are the target's rows at the positions before the anchor."""
    c = model.config
    t = len(prefix) - 1
    dev = next(model.parameters()).device
    n = min(t, c.window)
    ctx = torch.zeros(1, c.window, c.feature, device=dev)
    valid = torch.zeros(1, c.window, dtype=torch.bool, device=dev)
    pos = torch.zeros(1, c.window, dtype=torch.long, device=dev)
    if n:
        ctx[0, -n:] = hidden[t - n:t].to(dev, ctx.dtype)
        valid[0, -n:] = True
        pos[0, -n:] = torch.arange(t - n, t, device=dev)
    with torch.no_grad():
        z = model.block_logits(ctx.to(next(model.parameters()).dtype), valid, pos,
                               torch.tensor([prefix[-1]], device=dev), torch.tensor([t], device=dev))[0]

    def dist(pre) -> np.ndarray:
        j = len(pre) - len(prefix)
        if j >= c.block_size:
            return np.zeros(c.vocab_size)
        with torch.no_grad():
            logits = z[j] + model.markov(torch.tensor([pre[-1]], device=dev))[0]
        return adjust(logits.double().cpu().numpy(), 0.0)

    return dist


def ngram_chain(drafter: NgramDrafter, prefix: list[int], vocab: int):
    drafts = drafter.lookup(np.asarray(prefix, np.int64), K_MAX)

    def dist(pre) -> np.ndarray:
        j = len(pre) - len(prefix)
        out = np.zeros(vocab)
        if j < len(drafts):
            out[drafts[j]] = 1.0
        return out

    return dist


def exact_rounds(target: LlamaLM, drafters: dict, tokens: np.ndarray, offsets: np.ndarray,
                 starts: list[tuple[int, str, int]], layers: tuple[int, ...], progress=None) -> dict:
    """E_1..E_K per round start and drafter: {drafter: [[E_1..E_K] per start]}.
    drafters: name -> DSparkModel or NgramDrafter."""
    dists = TargetDists(target)
    vocab = target.config.vocab_size
    out = {name: [] for name in drafters}
    for d, _, t in progress(starts) if progress else starts:
        doc = tokens[offsets[d]:offsets[d + 1]].astype(np.int64)
        prefix = [int(x) for x in doc[:t + 1]]
        logits, hidden = dists.logits_hidden(prefix, layers)
        dists.remember(prefix, logits[-1])  # the round's first target call, already made
        for name, drafter in drafters.items():
            chain = (ngram_chain(drafter, prefix, vocab) if isinstance(drafter, NgramDrafter)
                     else dspark_chain(drafter, hidden, prefix))
            out[name].append([exact(dists, chain, prefix, k).mean for k in range(1, K_MAX + 1)])
    return out


def summarise(e: list[list[float]]) -> dict:
    """Mean E_k, accepted length 1 + E_k, reach and conditional acceptance per position."""
    e = np.asarray(e, np.float64)
    if not len(e):
        return {}
    reach = np.diff(np.concatenate([np.zeros((len(e), 1)), e], 1), axis=1).mean(0)
    cond = reach / np.concatenate([[1.0], reach[:-1]]).clip(min=1e-12)
    return {"rounds": len(e), "expected_accepted": e.mean(0).round(4).tolist(),
            "accepted_length": (1 + e.mean(0)).round(4).tolist(),
            "reach_per_position": reach.round(4).tolist(),
            "acceptance_per_position": cond.round(4).tolist()}


def by_class(per_start: list, starts: list) -> dict:
    out = {"validation (pooled)": summarise(per_start)}
    for name in CLASSES:
        rows = [e for e, s in zip(per_start, starts) if s[1] == name]
        if rows:
            out[name] = summarise(rows)
    return out


def measured(target: LlamaLM, spec: dict, tokens, offsets, starts, new_tokens: int,
             layers: tuple[int, ...], k: int = K_MAX) -> dict:
    """The reference speculative loop at T = 0 from each start's prefix, per drafter:
    {drafter: {class: {...}}}. spec: name -> a remote_drafter Drafter."""
    from remote_drafter.decode_loop import speculative_decode
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.transport import LocalTransport
    from remote_drafter.worker.service import DraftService

    out = {}
    for name, drafter in spec.items():
        per_class: dict[str, list] = {}
        for i, (d, klass, t) in enumerate(starts):
            prompt = [int(x) for x in tokens[offsets[d]:offsets[d] + t + 1]]
            client = DrafterClient(LocalTransport(DraftService(drafter)), depth=f"1024:{k}")
            hl = tuple(layers) if drafter.feature else ()
            r = speculative_decode(target, client, {i: prompt}, new_tokens, 0.0, hidden_layers=hl, k=k)
            per_class.setdefault(klass, []).extend(r.accepted)
        out[name] = {c: summarise_counts(v, k) for c, v in per_class.items()}
        out[name]["validation (pooled)"] = summarise_counts([a for v in per_class.values() for a in v], k)
    return out


def summarise_counts(accepted: list[int], k: int) -> dict:
    a = np.asarray(accepted)
    reach = [(a >= i).mean() for i in range(1, k + 1)]
    cond = [r / p if p else 0.0 for r, p in zip(reach, [1.0] + reach[:-1])]
    return {"rounds": len(a), "mean_accepted_length": round(1 + float(a.mean()), 4),
            "reach_per_position": np.round(reach, 4).tolist(),
            "acceptance_per_position": np.round(cond, 4).tolist()}
