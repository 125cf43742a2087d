"""A reference speculative engine in torch, no vLLM: a target model decodes several
requests with drafts from a DrafterClient (local, remote, or asynchronous) and the DSpark
rule. The exactness tests compare it with plain decoding; shadow runs and the benchmark
drive rounds with it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.sampling import is_greedy
from remote_drafter.engine.verify import sample, verify_chain
from remote_drafter.models.llama import LlamaLM


def target_probs(logits: torch.Tensor, temperature: float) -> np.ndarray:
    """[T, V] logits -> what the verifier samples from (one-hot argmax at T = 0)."""
    if is_greedy(temperature):
        out = np.zeros(tuple(logits.shape), np.float64)
        out[np.arange(len(out)), logits.argmax(-1).cpu().numpy()] = 1.0
        return out
    return torch.softmax(logits.double() / temperature, -1).cpu().numpy()


def run_target(target: LlamaLM, tokens: list[int], layers: tuple[int, ...] = ()):
    """The target's (logits, hidden) for `tokens`, on the host, wherever the target runs."""
    device = next(target.parameters()).device
    logits, hidden = target(torch.tensor(tokens, device=device), layers)
    return logits.cpu(), hidden.cpu()


def plain_decode(target: LlamaLM, prompt, new_tokens: int, temperature: float = 0.0,
                 rng: np.random.Generator | None = None) -> list[int]:
    seq, rng = list(prompt), rng or np.random.default_rng(0)
    for _ in range(new_tokens):
        logits, _ = run_target(target, seq)
        seq.append(sample(target_probs(logits[-1:], temperature)[0], rng))
    return seq[len(prompt):]


@dataclass
class SpecResult:
    tokens: dict = field(default_factory=dict)       # rid -> generated tokens
    accepted: list = field(default_factory=list)     # accepted drafts per (request, round)
    drafted: list = field(default_factory=list)      # drafts offered per (request, round)
    steps: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + float(np.mean(self.accepted)) if self.accepted else float("nan")


def speculative_decode(target: LlamaLM, client: DrafterClient, prompts: dict, new_tokens: int,
                       temperature: float = 0.0, hidden_layers: tuple[int, ...] = (),
                       k: int | None = None, mode: str = "sync", seed: int = 0,
                       use_probs: bool = True, on_round=None) -> SpecResult:
    """Decode every prompt with drafts. mode: 'sync' (propose) or 'async' (submit/collect).
    use_probs=False verifies against one-hot drafts (a proposer returning tokens only)."""
    rng, out = np.random.default_rng(seed), SpecResult()
    seqs = {}
    for rid, prompt in prompts.items():
        logits, hidden = run_target(target, list(prompt), hidden_layers)
        first = sample(target_probs(logits[-1:], temperature)[0], rng)
        seqs[rid] = list(prompt) + [first]
        out.tokens[rid] = [first]
        client.add_request(rid, seqs[rid], hidden if hidden_layers else None, temperature, seed + rid)
    while any(len(t) < new_tokens for t in out.tokens.values()):
        if mode == "async":
            client.submit(k)
            drafts = client.collect()
        else:
            drafts = client.propose(k)
        if on_round is not None:
            on_round(drafts)
        out.steps += 1
        for rid in list(seqs):
            if len(out.tokens[rid]) >= new_tokens:
                continue
            d = drafts.get(rid)
            tokens = d.tokens if d is not None else np.zeros(0, np.int32)
            seq, length = seqs[rid], len(seqs[rid])
            logits, hidden = run_target(target, seq + [int(t) for t in tokens], hidden_layers)
            p_t = target_probs(logits[length - 1:], temperature)
            p_d = d.probs if d is not None and use_probs else None
            n, nxt = verify_chain(tokens, p_d, p_t, rng)
            step = [int(t) for t in tokens[:n]] + [nxt]
            seq += step
            out.tokens[rid] += step
            out.accepted.append(n)
            out.drafted.append(len(tokens))
            client.commit(rid, step, hidden[length - 1:length + n] if hidden_layers else None)
    for rid in seqs:
        out.tokens[rid] = out.tokens[rid][:new_tokens]
        client.release(rid)
    return out
