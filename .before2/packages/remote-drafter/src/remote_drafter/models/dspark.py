"""The DSpark chain drafter (ARCHITECTURE.md § DSpark drafter), readable in one sitting.

Parallel stage: the block [anchor, mask x (W-1)] attends, in every layer, to itself
(bidirectionally) and to the context: the target's hidden rows of the last `window`
committed positions (k target layers concatenated), projected by Wc and RMS-normalised;
in token-only mode the context is the committed tokens' embeddings instead. One pass gives
z_1..z_W. Markov head: logits_i = z_i + W2 W1[x_{i-1}], left to right from x_0 = anchor.
Embedding and output head are the target's, frozen, and are not stored in the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from remote_drafter.engine.identity import (
    Manifest,
    digest_tensors,
    sha256_file,
    target_digest,
    tokenizer_digest,
)

from . import exl3
from .base import Draft, Drafter, DraftRequest
from .llama_layers import Block, RMSNorm
from .pick import Picker, split
from .staging import to_device_all
from .tensors import tensor_bytes
from .window import DeviceWindows

CONFIG_FILE, WEIGHTS_FILE = "drafter.json", "drafter.safetensors"


@dataclass
class DSparkConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 0          # 0: 4 x hidden
    block_size: int = 5                 # W: drafts per parallel pass
    markov_rank: int = 32
    window: int = 128                   # context positions attended (and kept per request)
    target_layers: list[int] = field(default_factory=list)  # empty: token-only mode
    target_hidden_size: int = 0
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    history_tokens: int = 4096

    @property
    def feature(self) -> int:
        return len(self.target_layers) * self.target_hidden_size

    @property
    def ffn(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.w1 = nn.Embedding(vocab, rank)
        self.w2 = nn.Linear(rank, vocab, bias=False)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w1(previous)).float()


class DSparkModel(nn.Module):
    def __init__(self, c: DSparkConfig, embed: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.config = c
        self.register_buffer("embed", embed, persistent=False)  # the target's, frozen
        self.register_buffer("head", head, persistent=False)
        self.ctx_proj = nn.Linear(c.feature or c.hidden_size, c.hidden_size, bias=False)
        self.ctx_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Block(c.hidden_size, c.num_heads, c.num_kv_heads, c.ffn,
                                          c.rms_norm_eps, c.rope_theta) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.markov = MarkovHead(c.vocab_size, c.markov_rank)

    def block_logits(self, ctx_in, ctx_valid, ctx_pos, anchor, anchor_pos) -> torch.Tensor:
        """ctx_in [B, C, F] (hidden rows, or token ids [B, C] in token-only mode), ctx_valid
        [B, C], ctx_pos [B, C], anchor [B], anchor_pos [B] -> z [B, W, V] float32."""
        c, (b, n_ctx) = self.config, ctx_valid.shape
        if not c.feature:
            ctx_in = self.embed[ctx_in]
        ctx = self.ctx_norm(self.ctx_proj(ctx_in.to(self.embed.dtype)))
        block = torch.full((b, c.block_size), c.mask_token_id, device=anchor.device)
        block[:, 0] = anchor
        x = self.embed[block]
        block_pos = anchor_pos[:, None] + torch.arange(c.block_size, device=anchor.device)
        allowed = torch.cat([ctx_valid[:, None, :].expand(b, c.block_size, n_ctx),
                             ctx_valid.new_ones(b, c.block_size, c.block_size)], -1)
        for layer in self.layers:
            x = layer(x, block_pos, allowed, context=ctx, ctx_pos=ctx_pos)
        return (self.norm(x) @ self.head.T).float()


def exl3_linears(state: dict) -> list[str]:
    """The weights an EXL3 pack quantises: every linear but the Markov head's."""
    return sorted(n for n in state if n.endswith(".weight")
                  and (n == "ctx_proj.weight" or ".self_attn." in n or ".mlp." in n))


def init_weights(model: DSparkModel, seed: int = 0, std: float = 0.02) -> DSparkModel:
    """A fresh drafter's weights: N(0, std) everywhere but the norms (ones)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    return model


def load_target_embedding(folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output head (tied checkpoints: the same tensor)."""
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in ("model.embed_tokens.weight", "lm_head.weight"):
                    if key in f.keys():
                        found[key] = f.get_tensor(key)
    if "model.embed_tokens.weight" not in found:
        raise ValueError(f"{folder}: no model.embed_tokens.weight (not a Llama-style target)")
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)


class DSparkDrafter(Drafter):
    kind = "dspark"

    def __init__(self, config: DSparkConfig, model: DSparkModel, manifest: Manifest, device: str):
        self.config, self.model, self._manifest, self.device = config, model, manifest, device
        self.vocab_size, self.feature = config.vocab_size, config.feature
        self.max_depth, self.window = config.block_size, config.window
        self.history_tokens, self.hidden_layers = config.history_tokens, tuple(config.target_layers)
        self._windows = DeviceWindows(self.window, self.feature)  # device -> its requests' rings

    def manifest(self) -> Manifest:
        return self._manifest

    # -- checkpoints -----------------------------------------------------------------------
    @staticmethod
    def create(out: str, target: str, config: DSparkConfig, seed: int = 0,
               init_std: float = 0.02) -> str:
        """A randomly initialised drafter for `target`, written to `out` (training comes later)."""
        embed, head = load_target_embedding(target)
        model = init_weights(DSparkModel(config, embed, head), seed, init_std)
        return DSparkDrafter.save(out, model, target_digest(target), tokenizer_digest(target))

    @staticmethod
    def save(out: str, model: DSparkModel, target: str, tokenizer: str,
             dtype: torch.dtype | None = None) -> str:
        """Write `model` (its own weights, in `dtype` if given; never the target's embedding
        and head) with the target and tokenizer digests it was built for."""
        os.makedirs(out, exist_ok=True)
        meta = {**asdict(model.config), "target_digest": target, "tokenizer_digest": tokenizer}
        with open(os.path.join(out, CONFIG_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        save_file({k: v.detach().to(dtype or v.dtype).contiguous().cpu()
                   for k, v in model.state_dict().items()}, os.path.join(out, WEIGHTS_FILE))
        return out

    @classmethod
    def load(cls, folder: str, target: str | None, device: str = "cpu",
             dtype: torch.dtype = torch.float32) -> DSparkDrafter:
        with open(os.path.join(folder, CONFIG_FILE)) as f:
            meta = json.load(f)
        built_for, tokenizer = meta.pop("target_digest"), meta.pop("tokenizer_digest")
        config = DSparkConfig(**meta)
        if not target:
            raise ValueError("a DSpark drafter shares the target's embedding and head: pass the "
                             "target checkpoint folder (--target)")
        if target_digest(target) != built_for:
            raise ValueError(f"{folder} was built for target {built_for[:16]}, but {target} is "
                             f"{target_digest(target)[:16]}")
        state = load_file(os.path.join(folder, WEIGHTS_FILE))
        embed, head = load_target_embedding(target)
        model = DSparkModel(config, embed, head)
        quantised = exl3.read_pack(folder)["linears"] if exl3.is_pack(folder) else []
        if quantised:
            exl3.require(device)
            dense = {k: v for k, v in state.items() if not exl3.is_exl3_tensor(k)}
            missing, unexpected = model.load_state_dict(dense, strict=False)
            if sorted(missing) != sorted(quantised) or unexpected:
                raise ValueError(f"{folder}: EXL3 pack does not match its drafter.json "
                                 f"(missing {sorted(set(missing) - set(quantised))[:3]}, "
                                 f"unexpected {unexpected[:3]})")
        else:
            model.load_state_dict(state, strict=True)
        model = model.to(device=device, dtype=dtype).eval()
        exl3.install(model, state, quantised, device)
        config_bytes = json.dumps(asdict(config), sort_keys=True).encode()
        names = sorted(state)
        manifest = Manifest(
            target=built_for, tokenizer=tokenizer, kind=cls.kind,
            drafter=digest_tensors([("config", config_bytes)] + [
                (n, tensor_bytes(state[n])) for n in names if not n.startswith("markov.")]),
            markov=digest_tensors([(n, tensor_bytes(state[n])) for n in names
                                   if n.startswith("markov.")]))
        return cls(config, model, manifest, device)

    @staticmethod
    def convert_exl3(folder: str, out: str, bits: float, device: str, log=None) -> dict:
        """An EXL3 pack of the drafter in `folder`: its linears (ctx_proj, attention, MLP)
        quantised at `bits`; norms and the Markov head as stored (the embedding and head are
        the target's, never stored)."""
        state = load_file(os.path.join(folder, WEIGHTS_FILE))
        names = exl3_linears(state)
        packed = exl3.quantise_all(state, names, dict.fromkeys(names, bits), device, log)
        os.makedirs(out, exist_ok=True)
        shutil.copyfile(os.path.join(folder, CONFIG_FILE), os.path.join(out, CONFIG_FILE))
        save_file(packed, os.path.join(out, WEIGHTS_FILE))
        meta = {"kind": "dspark", "bits": bits, "linears": names,
                "source_sha256": sha256_file(os.path.join(folder, WEIGHTS_FILE))}
        exl3.write_pack(out, meta)
        return meta

    # -- drafting --------------------------------------------------------------------------
    def _context(self, requests: list[DraftRequest]):
        """The batch's context as numpy arrays on the host, for callers that lay a round out
        themselves (native_drafter's reference, checks): _inputs on the CPU."""
        return tuple(t.numpy() for t in self._inputs(requests, "cpu"))

    @torch.inference_mode()
    def _inputs(self, requests: list[DraftRequest], device):
        """(ctx, valid, pos) on `device`: each request's context right-aligned in a fixed
        window, so every row of a batch has the same shapes and padding never leaks into a
        request (the bits may still differ with the batch size, as BLAS sums differently for
        another row count). Hidden rows are assembled from each request's copy on the device
        (window.py), so only rows committed since its last round cross to it."""
        b, n = len(requests), self.window
        if self.feature:
            plan = self._windows.plan([r.history for r in requests], device)
            m = plan.kept
        else:
            known = [r.history.tokens[:-1][-n:] for r in requests]
            m = np.array([len(k) for k in known], np.int64)
            ctx = np.zeros((b, n), np.int64)
            for i, k in enumerate(known):
                ctx[i, n - len(k):] = k
        valid = np.arange(n) >= n - m[:, None]
        lengths = np.array([r.history.length for r in requests], np.int64)
        pos = np.where(valid, lengths[:, None] - 1 - n + np.arange(n), 0)
        if self.feature:  # the small arrays in the windows' one copy
            valid, pos = plan.send(valid, pos)
            return plan.context(), valid.bool(), pos
        ctx, valid, pos = to_device_all([ctx, valid, pos], device)
        return ctx, valid.bool(), pos

    @torch.inference_mode()
    def draft(self, requests: list[DraftRequest], want_probs: bool) -> list[Draft]:
        dev = self.device
        ctx, valid, pos = self._inputs(requests, dev)
        anchor, anchor_pos = to_device_all([np.array([int(r.history.tokens[-1]) for r in requests]),
                                            np.array([r.history.length - 1 for r in requests])], dev)
        z = self.model.block_logits(ctx, valid, pos, anchor, anchor_pos)
        pick, previous = Picker(requests, want_probs), anchor
        for i in range(max(r.depth for r in requests)):
            logits = z[:, i] + self.model.markov(previous)
            previous = pick(logits, [r.history.length + i for r in requests])
        return split(requests, *pick.finish())
