"""Self-distillation of the DSpark drafter from the frozen target, on a time budget.

Each step: the teacher runs on `rows` token rows of the training split (logits and the
hidden rows of the drafter's target layers), every anchor of those rows becomes a training
example (objective.make_batch), and the fast path takes optimiser steps over them in
batches of `anchors`. Before the first step the gate compares the fast path with the
reference on fixed batches; it runs again on the trained weights before the checkpoint is
written. A failed gate raises GateFailed and nothing is written.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter, DSparkModel, init_weights
from remote_drafter.models.llama import LlamaLM

from . import comparison as gate_mod
from .fast import TOLERANCES, FastPath, training_gate
from .objective import Objective, anchors, make_batch, reference_loss
from .teacher import teacher_forward

TARGET_LAYERS = (2, 15, 29)  # `remote-drafter init`'s default: low, middle, last of 30


@dataclass
class TrainConfig:
    minutes: float = 7.0        # wall-clock budget of the optimisation loop (about one epoch:
                                # findings/drafter-training.md)
    rows: int = 16              # token rows per teacher pass
    length: int = 512           # tokens per row (documents are cut into such rows)
    anchors: int = 2048         # anchors per optimiser step
    lr: float = 1.5e-3
    warmup_steps: int = 40
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    gate_anchors: int = 192     # per gate batch (the float32 reference keeps all of it)
    gate_batches: int = 2
    compile: bool = True
    max_steps: int = 0          # > 0: stop after this many steps (tests), else time/data
    target_layers: tuple[int, ...] = TARGET_LAYERS  # whose hidden rows condition the drafter


def drafter_config(target: LlamaLM, layers=TARGET_LAYERS, num_layers: int = 3,
                   markov_rank: int = 32, block: int = 5, window: int = 128) -> DSparkConfig:
    """The miniature's drafter (ARCHITECTURE.md § DSpark drafter): three layers at the target's width and head
    layout, conditioned on three target layers, W = 5, window 128, Markov rank 32."""
    t = target.config
    return DSparkConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=num_layers,
        num_heads=t.num_attention_heads, num_kv_heads=t.num_key_value_heads,
        intermediate_size=t.intermediate_size, block_size=block, markov_rank=markov_rank,
        window=window, target_layers=list(layers), target_hidden_size=t.hidden_size,
        mask_token_id=t.vocab_size - 1, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta)


def cut_rows(offsets: np.ndarray, length: int, min_tokens: int) -> np.ndarray:
    """(start, end) token ranges: each document cut into pieces of `length`; pieces
    shorter than `min_tokens` are dropped."""
    out = []
    for a, b in zip(offsets[:-1], offsets[1:]):
        for s in range(int(a), int(b), length):
            if min(s + length, int(b)) - s >= min_tokens:
                out.append((s, min(s + length, int(b))))
    return np.asarray(out, np.int64).reshape(-1, 2)


class Rows:
    """Token rows in a seeded random order, epoch after epoch, padded into [S, L]."""

    def __init__(self, tokens: np.ndarray, ranges: np.ndarray, rows: int, length: int, seed: int):
        if len(ranges) < rows:
            raise ValueError(f"only {len(ranges)} token rows, {rows} wanted per batch")
        self.tokens, self.ranges, self.rows, self.length = tokens, ranges, rows, length
        self.rng, self.order, self.next, self.epoch = np.random.default_rng(seed), None, 0, 0
        self._shuffle()

    def _shuffle(self):
        self.order, self.next = self.rng.permutation(len(self.ranges)), 0

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.next + self.rows > len(self.order):
            self.epoch += 1
            self._shuffle()
        pick = self.ranges[self.order[self.next:self.next + self.rows]]
        self.next += self.rows
        out = np.zeros((self.rows, self.length), np.int64)
        for i, (a, b) in enumerate(pick):
            out[i, :b - a] = self.tokens[a:b]
        return torch.from_numpy(out), torch.from_numpy(pick[:, 1] - pick[:, 0])


def teacher_batches(teacher: LlamaLM, config: DSparkConfig, tokens, lengths, anchors_per: int,
                    generator: torch.Generator, device):
    """The teacher's pass over one [S, L] token batch, cut into shuffled anchor batches."""
    tokens = tokens.to(device)
    with torch.no_grad():
        logits, hidden = teacher_forward(teacher, tokens, tuple(config.target_layers))
    rows, starts = anchors(lengths, config.block_size)
    perm = torch.randperm(len(rows), generator=generator)
    for i in range(0, len(perm) - anchors_per + 1, anchors_per):
        idx = perm[i:i + anchors_per]
        yield make_batch(tokens, logits, hidden, rows[idx].to(device), starts[idx].to(device),
                         config.window, config.block_size)


@torch.no_grad()
def measure(model: DSparkModel, batches, objective: Objective) -> dict:
    """Teacher-forced figures on fixed batches: loss, and per draft position the mean
    alpha = sum min(p_d, p_t) (acceptance probability at T = 1) and top-1 agreement
    (acceptance at T = 0), each given that the earlier drafts equal the text."""
    losses, alpha, top1 = [], [], []
    for b in batches:
        loss, logits = reference_loss(model, b, objective)
        p_d, p_t = torch.softmax(logits, -1), torch.softmax(b.teacher.float(), -1)
        losses.append(loss.item())
        alpha.append(torch.minimum(p_d, p_t).sum(-1).mean(0))
        top1.append((logits.argmax(-1) == b.teacher.argmax(-1)).float().mean(0))
    return {"loss": float(np.mean(losses)),
            "alpha_per_position": torch.stack(alpha).mean(0).tolist(),
            "top1_per_position": torch.stack(top1).mean(0).tolist()}


def lr_at(cfg: TrainConfig, step: int, fraction: float) -> float:
    """Linear warm-up, then cosine decay over the elapsed fraction of the budget."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    return cfg.lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, fraction))))


def train(teacher: LlamaLM, train_tokens: np.ndarray, train_offsets: np.ndarray,
          val_tokens: np.ndarray, val_offsets: np.ndarray, cfg: TrainConfig, out: str,
          identity: dict, provenance: dict, device: str = "cuda", log=print,
          fast: FastPath | None = None) -> dict:
    """Gate, train, gate again, write the checkpoint (bf16) and training.json into `out`.
    `identity`: the target_digest and tokenizer_digest the checkpoint is built for; `fast`:
    the fast path (default: FastPath(compile=cfg.compile))."""
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # the teacher's float32 matmuls (gate turns it off)
    dc = drafter_config(teacher, cfg.target_layers)
    model = init_weights(DSparkModel(dc, teacher.model.embed_tokens.weight.detach(),
                                     teacher.head_weight.detach()), cfg.seed).to(device)
    objective, fast = Objective(), fast or FastPath(compile=cfg.compile)
    gen = torch.Generator().manual_seed(cfg.seed)
    min_tokens = dc.block_size + 16
    train_rows = Rows(train_tokens, cut_rows(train_offsets, cfg.length, min_tokens),
                      cfg.rows, cfg.length, cfg.seed)
    val_rows = Rows(val_tokens, cut_rows(val_offsets, cfg.length, min_tokens),
                    cfg.rows, cfg.length, cfg.seed + 1)

    def fixed(rows: Rows, n: int, size: int) -> list:
        tokens, lengths = rows.batch()
        out = [b for _, b in zip(range(n), teacher_batches(teacher, dc, tokens, lengths, size, gen, device))]
        if not out:
            raise ValueError(f"a batch of {cfg.rows} rows holds fewer than {size} anchors")
        return out

    gate_set = fixed(train_rows, cfg.gate_batches, cfg.gate_anchors)
    val_set = fixed(val_rows, 4, min(512, cfg.anchors))
    t0 = time.time()
    before = training_gate(model, gate_set, fast, objective)
    gate_s = time.time() - t0
    log(before.table(("batch0/loss", "batch0/logits", "batch0/grad/")))
    gate_mod.write(before, os.path.join(out, "gate-before.json"), tolerances=TOLERANCES)
    before.raise_for_failure()
    untrained = measure(model, val_set, objective)

    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    other = [p for n, p in model.named_parameters() if "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(0.9, 0.95), fused=device.startswith("cuda"))
    budget, history, step, seen_tokens, anchors_done = cfg.minutes * 60, [], 0, 0, 0
    start = time.time()
    bar = tqdm(total=int(budget), desc="train", unit="s")
    done = False
    while not done:
        tokens, lengths = train_rows.batch()
        seen_tokens += int(lengths.sum())
        for batch in teacher_batches(teacher, dc, tokens, lengths, cfg.anchors, gen, device):
            elapsed = time.time() - start
            if elapsed >= budget or (cfg.max_steps and step >= cfg.max_steps):
                done = True
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step, elapsed / budget)
            loss, _ = fast.loss(model, batch)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            anchors_done += len(batch)
            if step % 25 == 0 or step == 1:
                row = {"step": step, "s": round(time.time() - start, 1), "loss": loss.item(),
                       "grad_norm": norm.item(), "lr": opt.param_groups[0]["lr"],
                       "tokens": seen_tokens, "epoch": train_rows.epoch}
                history.append(row)
                bar.set_postfix(loss=f"{row['loss']:.3f}", step=step)
                bar.n = int(min(budget, time.time() - start))
                bar.refresh()
    bar.close()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    train_s = time.time() - start
    after = training_gate(model, gate_set, fast, objective)
    log(after.table(("batch0/loss", "batch0/logits", "batch0/grad/")))
    gate_mod.write(after, os.path.join(out, "gate-after.json"), tolerances=TOLERANCES)
    # On trained weights loss and logits must still match. Gradients are recorded, not
    # gated: near a minimum a gradient is a sum of nearly cancelling terms, and its
    # relative error measures bf16 rounding of those terms, not the fast path's math
    # (the gate before training, at a generic point, checks every gradient).
    gate_mod.GateReport([c for c in after.checks if "/grad/" not in c.name]).raise_for_failure()
    trained = measure(model, val_set, objective)
    ckpt = os.path.join(out, "checkpoint")
    DSparkDrafter.save(ckpt, model, identity["target_digest"], identity["tokenizer_digest"],
                       dtype=torch.bfloat16)
    figures = {
        "config": asdict(cfg), "drafter": asdict(dc), "steps": step, "train_seconds": round(train_s, 1),
        "gate_seconds": round(gate_s, 1), "anchors": anchors_done, "tokens_seen": seen_tokens,
        "epochs": train_rows.epoch + train_rows.next / max(1, len(train_rows.order)),
        "anchors_per_second": anchors_done / train_s, "final_loss": history[-1]["loss"] if history else None,
        "validation_untrained": untrained, "validation_trained": trained,
        "gate_before_passed": before.passed, "gate_after_all_passed": after.passed,
        "gate_worst_before": {p: asdict(before.worst(p)) for p in ("batch0/loss", "batch0/logits", "batch0/grad/")},
        "gate_worst_after": {p: asdict(after.worst(p)) for p in ("batch0/loss", "batch0/logits", "batch0/grad/")},
        "history": history, **provenance,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
    }
    with open(os.path.join(ckpt, "training.json"), "w") as f:
        json.dump(figures, f, indent=1)
    return figures
