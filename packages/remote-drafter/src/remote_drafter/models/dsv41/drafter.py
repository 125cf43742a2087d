"""DeepSeek-V4.1's own DSpark drafter (the `mtp.*` tensors of its checkpoint) behind the
Drafter interface: kind "dsv41", served as `remote-drafter worker --drafter dsv41:<folder>`;
a DeepSeek-V4 checkpoint's drafter the same way (its config's model_type picks the variant).

A round for B requests: each request's context rows (every drafter layer's key/value row
of each of its last `sliding_window` committed positions, post kv_norm and RoPE) live on the
device (window.py) and only rows committed since its last round are encoded; one parallel
pass over the B blocks gives W base logits each; then the Markov head runs left to right,
draft i drawn (argmax at T = 0, a seeded draw otherwise: pick.py) from z_i plus the bias of
draft i-1, and the confidence head scores each draft. With a confidence cut-off, each
request's draft ends before its first draft scored below it (exllamav3's trim; vLLM uses
the head only for adaptive verification).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import fields, replace

import numpy as np
import torch
from safetensors.torch import save_file

from remote_drafter import env
from remote_drafter.engine.identity import Manifest, target_digest, tokenizer_digest
from remote_drafter.engine.sampling import is_greedy
from remote_drafter.models import exl3, exl3_dense
from remote_drafter.models.base import Draft, Drafter, DraftRequest
from remote_drafter.models.cuda_graphs import BucketGraphs, graph_ms
from remote_drafter.models.pick import Picker, chain_arrays, split
from remote_drafter.models.window import DeviceWindows

from . import checkpoint, exl3_pack
from .config import flatten, linear_names
from .model import FAILED_HERE, Dsv41Model

log = logging.getLogger(__name__)
GRAPH_BATCHES = [1, 2, 4, 8, 16]  # buckets captured at start-up; larger rounds run eagerly
# New rows a round encodes (each request's committed tokens since its last round; an open's
# window): captured like the round, as a dozen small launches cost more than their work.
ENCODE_BUCKETS = [4, 16, 64, 256]
ATTENTION_CALLS_TIMED = 10  # a form's calls in one timed graph: a replay's own cost spread thin


def dense_budget_mib() -> int:
    """REMOTE_DRAFTER_EXL3_DENSE_MIB, checked."""
    text = env.REMOTE_DRAFTER_EXL3_DENSE_MIB.get().strip()
    if not text.isdigit():
        raise ValueError(f"REMOTE_DRAFTER_EXL3_DENSE_MIB={text!r}: a whole number of MiB "
                         "(0: exllamav3's kernels only)")
    return int(text)


class Dsv41Drafter(Drafter):
    kind = "dsv41"

    def __init__(self, model: Dsv41Model, manifest: Manifest, device="cpu",
                 confidence_cutoff: float = 0.0, cuda_graphs: bool | None = False,
                 fuse_experts: bool = True, round_kernels: bool = True, dense_mib: int | None = None):
        """cuda_graphs None: capture unless EXL3 experts run per matrix (then every served
        expert would run on every row). fuse_experts False: EXL3 experts per matrix (the
        baseline the fused kernels are measured against). round_kernels False: the
        hyper-connection mixes, RoPE, the norms, the routers, the greedy chain's top two and the
        attention in torch on CUDA too (the baseline of kernels.py). dense_mib: the budget of EXL3 linears' dense
        copies (default REMOTE_DRAFTER_EXL3_DENSE_MIB; 0: no new copies, those an earlier
        drafter of this model chose still serve)."""
        c = model.config
        if confidence_cutoff > 0 and model.confidence is None:
            raise ValueError("a confidence cut-off needs the checkpoint's confidence head, "
                             "which this one lacks")
        self.model, self.config, self._manifest, self.device = model, c, manifest, device
        self.vocab_size, self.feature = c.vocab_size, c.feature_width
        self.max_depth, self.window = c.block_size, c.sliding_window
        self.hidden_layers = c.target_layer_ids
        self.confidence_cutoff = confidence_cutoff
        self._windows = DeviceWindows(self.window, c.n_mtp_layers * c.head_dim, self._encode,
                                      model.dtype)
        self._forward = BucketGraphs(self._block, device)
        self._encode_rows = BucketGraphs(model.encode_rows, device)
        self.experts = "dense"
        if self._forward.cuda:
            why = model.use_kernels(round_kernels)
            if why and round_kernels:
                log.warning("the round's Triton kernels do not serve, torch does (slower rounds): %s", why)
            elif model.numerics.attention_refusal:
                log.warning("the attention kernel does not serve, torch attends (slower rounds): %s",
                            model.numerics.attention_refusal)
        else:  # the CPU: torch unless a caller (a test) chose the kernels for the model
            why = None if model.numerics.kernels else "cpu"
        self._kernels_why = why
        if self._forward.cuda:
            self._choose_attention()
        if model.served and self._forward.cuda:
            if model.experts_fused and not fuse_experts:
                raise ValueError("this model's EXL3 experts are fused already (another drafter's "
                                 "CUDA graphs use their buffers): load it again for the per-matrix path")
            why = model.fuse_exl3_experts() if fuse_experts else "not asked to"
            if why:
                log.warning("EXL3 experts run per matrix, not fused (slower rounds): %s", why)
            self.experts = "exl3 fused" if why is None else f"exl3 per matrix ({why})"
            if why is None:  # before the dense copies (ours runs the shared expert itself) and the capture
                self.experts = self._choose_expert_kernels()
            self._keep_dense(dense_mib)
        if cuda_graphs is None:
            cuda_graphs = not model.served or model.experts_fused
        if cuda_graphs and self._forward.cuda:  # CPU: eager whatever is asked
            self.prepare_graphs()
            self._forward.capture(GRAPH_BATCHES, self._blank)
            self._encode_rows.capture(ENCODE_BUCKETS, self._blank_rows)

    def _keep_dense(self, mib: int | None) -> None:
        """Dense copies of EXL3 linears where they are faster here, measured at the row counts
        this drafter's captured rounds and encodings run (before the capture, which bakes
        them in)."""
        if mib is None:
            mib = dense_budget_mib()
        chosen = self.model.keep_dense_exl3([b * self.max_depth for b in GRAPH_BATCHES], ENCODE_BUCKETS,
                                            mib << 20)
        if chosen:
            log.info("EXL3: %d linears also hold dense fp16 copies (%.0f MiB), faster on this GPU "
                     "from %d rows", len(chosen), sum(c.nbytes for c in chosen) / 2**20,
                     min(c.from_rows for c in chosen))

    def _choose_attention(self) -> None:
        """The attention kernel's form per captured batch (REMOTE_DRAFTER_ATTENTION), timed
        here, before the capture bakes it in. Once a model: a later drafter of the same model
        keeps what the first chose (the first one's graphs run it)."""
        var, num = env.REMOTE_DRAFTER_ATTENTION, self.model.numerics
        mode = var.get().strip() or var.default
        if mode not in var.choices:
            raise ValueError(f"REMOTE_DRAFTER_ATTENTION={mode!r}: one of {', '.join(var.choices)}")
        if num.kernels is None or num.attention_refusal is not None or num.attend_chosen is not None:
            return
        if mode == "default":
            num.attend_chosen = {}
            return
        started = time.monotonic()
        chosen = self.model.choose_attention(GRAPH_BATCHES, lambda fn: graph_ms(
            lambda: [fn() for _ in range(ATTENTION_CALLS_TIMED)], self.device) / ATTENTION_CALLS_TIMED)
        log.info("attention kernel's form per batch (REMOTE_DRAFTER_ATTENTION=auto, chosen in %.1f s): %s",
                 time.monotonic() - started, chosen)

    @property
    def attention(self) -> dict[int, str] | str:
        """The attention kernel's form per batch, as status shows it."""
        num = self.model.numerics
        if num.kernels is None or num.attention_refusal is not None:
            return "torch attends"
        return num.attend_chosen or "the kernel's defaults"

    def _choose_expert_kernels(self) -> str:
        """Ours or exllamav3's fused experts per round row count (REMOTE_DRAFTER_EXL3_EXPERTS)."""
        mode = env.REMOTE_DRAFTER_EXL3_EXPERTS.get().strip() or env.REMOTE_DRAFTER_EXL3_EXPERTS.default
        started = time.monotonic()
        chosen, refusal = self.model.choose_expert_kernels([b * self.max_depth for b in GRAPH_BATCHES], mode)
        if mode != "exllamav3" and refusal is not None:  # a pack ours does not read is no surprise under auto
            warn = mode == "ours" or refusal.startswith(FAILED_HERE)
            log.log(logging.WARNING if warn else logging.INFO,
                    "REMOTE_DRAFTER_EXL3_EXPERTS=%s, but exllamav3's kernels serve: %s", mode, refusal)
        log.info("EXL3 experts (REMOTE_DRAFTER_EXL3_EXPERTS=%s, chosen in %.1f s): %s", mode,
                 time.monotonic() - started, chosen)
        return chosen

    def prepare_graphs(self) -> None:
        """Experts whose round a CUDA graph can hold (no host read of the routing): dense
        ones stacked (grouped GEMMs where they match), EXL3 ones fused or else each on every row."""
        model = self.model
        if not model.served:
            why = model.stack_experts()
            self.experts = ("dense, the chosen experts in grouped GEMMs" if why is None
                            else f"dense, every expert on every row ({why})")
        elif not model.experts_fused:
            model.every_expert_on_every_row()

    @classmethod
    def load(cls, folder: str, target: str | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None, confidence_cutoff: float | None = None) -> Dsv41Drafter:
        """The drafter of the DeepSeek-V4.1 checkpoint in `folder`, serving `target` (the
        folder the engine decodes with; default `folder` itself, where DeepSeek ships it),
        whose vocabulary it must share. Float32 unless `dtype` says otherwise."""
        loaded = (exl3_pack.load if exl3.is_pack(folder) else checkpoint.load)(
            folder, dtype or torch.float32, device)
        manifest = cls.manifest_for(folder, target, loaded.config, loaded.drafter_digest, loaded.markov_digest)
        if confidence_cutoff is None:
            confidence_cutoff = float(env.REMOTE_DRAFTER_CONFIDENCE_CUTOFF.get() or 0)
        linears = getattr(loaded, "linears", None)
        if getattr(loaded, "not_read", None):
            log.warning("%s: %d stored drafter tensors that no weight of %s uses: %s", folder,
                        len(loaded.not_read), loaded.config.name, ", ".join(loaded.not_read[:8]))
        setting = env.REMOTE_DRAFTER_CUDA_GRAPHS.get()
        if why := env.REMOTE_DRAFTER_CUDA_GRAPHS.problem(setting):
            raise ValueError(why)
        graphs = {"1": True, "0": False}.get(setting)  # auto: see __init__
        return cls(Dsv41Model(loaded.config, loaded.weights, device, linears=linears),
                   manifest, device, confidence_cutoff, graphs)

    @classmethod
    def manifest_for(cls, folder: str, target: str | None, config, drafter_digest: str,
                     markov_digest: str) -> Manifest:
        """The identity of the drafter in `folder` serving `target` (default: `folder`),
        whose vocabulary it must share."""
        served = target or folder
        vocab = flatten(checkpoint.read_config(served)).get("vocab_size")
        if vocab != config.vocab_size:
            raise ValueError(f"{folder}'s drafter has a vocabulary of {config.vocab_size}, "
                             f"the target {served} of {vocab}")
        return Manifest(target_digest(served), tokenizer_digest(served), drafter_digest, markov_digest, cls.kind)

    @staticmethod
    def convert_exl3(folder: str, out: str, bits: float, head_bits: float | None, device: str,
                     log=None) -> dict:
        """An EXL3 pack of the drafter in checkpoint `folder`: its linears (linear_names;
        wo_a one slice per output group, as exllamav3 stores it) at `bits`, the shared head
        at `head_bits` if given; everything else dequantised as checkpoint.load reads it.
        The pack's config.json is the checkpoint's without its quantization_config."""
        loaded = checkpoint.load(folder, torch.bfloat16, "cpu")
        c = loaded.config
        weights, bits_of = dict(loaded.weights), {}
        for name in linear_names(c):
            if name.endswith(".attn.wo_a.weight"):
                slices = weights.pop(name).view(c.o_groups, c.o_lora_rank, -1)
                for g in range(c.o_groups):
                    weights[f"{name.removesuffix('.weight')}.slice.{g}.weight"] = slices[g]
                    bits_of[f"{name.removesuffix('.weight')}.slice.{g}.weight"] = bits
            else:
                bits_of[name] = bits
        if head_bits:
            bits_of["head.weight"] = head_bits
        packed = exl3.quantise_all(weights, list(bits_of), bits_of, device, log)
        os.makedirs(out, exist_ok=True)
        config = checkpoint.read_config(folder)
        (config.get("text_config") or config).pop("quantization_config", None)
        config.pop("quantization_config", None)
        with open(os.path.join(out, checkpoint.CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=1)
        save_file({k: v.contiguous() for k, v in packed.items()},
                  os.path.join(out, checkpoint.SINGLE_FILE))
        meta = {"kind": "dsv41", "bits": bits, "head_bits": head_bits,
                "linears": sorted(set(linear_names(c)) | ({"head.weight"} if head_bits else set())),
                "source_drafter_digest": loaded.drafter_digest}
        exl3.write_pack(out, meta)
        return meta

    @property
    def round_kernels(self) -> str:
        """What runs the round's mixes, RoPE, norms, routers, top two and attention. The model's
        choice: a drafter built later over the same model with another choice changes it for
        this one too."""
        num, served = self.model.numerics, "mHC, RoPE, norms, routers, top two"
        if num.kernels is not None:
            if num.attention_refusal:
                return f"triton ({served}); torch attends ({num.attention_refusal})"
            return f"triton ({served}, attention)"
        return f"torch ({self._kernels_why or 'another drafter of this model chose it'})"

    def manifest(self) -> Manifest:
        return self._manifest

    def describe(self) -> dict:
        return {**super().describe(), "confidence_head": self.model.confidence is not None,
                "confidence_cutoff": self.confidence_cutoff,
                "experts": self.experts, "round_kernels": self.round_kernels, "attention": self.attention,
                "exl3_dense": exl3_dense.describe(self.model.dense_exl3) if self.model.served else "no EXL3 weights",
                "cuda_graphs": sorted(self._forward.graphs) or "off (eager rounds)",
                "encode_graphs": sorted(self._encode_rows.graphs) or "off (eager)"}

    def _block(self, ctx, meta) -> tuple[torch.Tensor, ...]:
        """ctx [B, window, layers, head_dim], each request's context rows right-aligned; meta
        [B, 3] int64: how many of them are valid, the seed token, its position. One parallel
        pass: (pre-norm hidden, base logits) of each request's block, and the
        greedy chain over the whole block on the device, packed in one float64 tensor
        [B, W, 4 (+1 with a confidence head)]: the token's probability and the runner-up's,
        both tokens (the drafted one first), confidence. A greedy round reads this alone, so its Markov head runs
        inside the captured graph and one copy brings the round back."""
        model = self.model
        markov, confidence = model.markov, model.confidence
        kept, seed, p0 = meta.unbind(1)
        n = ctx.shape[1]
        valid = torch.arange(n, device=ctx.device) >= n - kept[:, None]  # padding rows: kept 0, none
        h = model.block_hidden(ctx, valid, seed, p0)
        z = model.head(h)
        previous, probs, tokens, embedded = seed, [], [], []
        for i in range(self.max_depth):
            m = markov.embed(previous)
            p2, i2 = model.numerics.top_two(z[:, i], markov.bias(m))  # = top_two(markov.logits(z[:, i], m))
            probs.append(p2)
            tokens.append(i2)
            embedded.append(m)
            previous = i2[:, 0]
        # packed once for the whole chain (casting and joining each step's would launch a kernel
        # each), and the confidence of every step in one pass (a sampled round's over its depth:
        # a product over other rows may round another way in the last bit)
        packed = [torch.stack(part, 1).double() for part in (probs, tokens)]
        if confidence is not None:
            packed.append(confidence(h, torch.stack(embedded, 1))[..., None].double())
        return h, z, torch.cat(packed, -1)

    def _blank(self, b: int) -> tuple[torch.Tensor, ...]:
        c, dev = self.config, self.device
        return (torch.zeros(b, self.window, c.n_mtp_layers, c.head_dim, dtype=self.model.dtype, device=dev),
                torch.zeros(b, 3, dtype=torch.int64, device=dev))

    def _blank_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(n, self.feature, dtype=self.model.dtype, device=self.device),
                torch.zeros(n, dtype=torch.int64, device=self.device))

    def _encode(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """New committed taps -> every layer's context rows, computed once per position."""
        return self._encode_rows(taps, positions)

    @torch.inference_mode()
    def draft(self, requests: list[DraftRequest], want_probs: bool) -> list[Draft]:
        model, dev, c = self.model, self.device, self.config
        b, n = len(requests), self.window
        plan = self._windows.plan([r.history for r in requests], dev)  # one shape for the batch
        meta, = plan.send(np.array([[k, int(r.history.tokens[-1]), r.history.length - 1]
                                    for k, r in zip(plan.kept.tolist(), requests)], np.int64))
        seed = meta[:, 1]
        h, z, chain = self._forward(plan.context().view(b, n, c.n_mtp_layers, c.head_dim), meta)
        depth = max(r.depth for r in requests)
        if all(is_greedy(r.temperature) for r in requests):  # the device's chain: one copy back
            tokens, top_p, top_i, scores = unpack_chain(chain[:, :depth].cpu().numpy())
            probs = np.zeros((b, depth, self.vocab_size), np.float32) if want_probs else None
            drafts = split(requests, *chain_arrays(tokens, top_p, top_i, top_p[..., 0], probs, [True] * b))
        else:
            pick, previous, embedded = Picker(requests, want_probs), seed, []
            for i in range(depth):
                m = model.markov.embed(previous)
                embedded.append(m)
                previous = pick(model.markov.logits(z[:, i], m), [r.history.length + i for r in requests])
            drafts = split(requests, *pick.finish())
            scores = None if model.confidence is None else \
                model.confidence(h[:, :depth], torch.stack(embedded, 1)).float().cpu().numpy()
        if model.confidence is None:
            return drafts
        return [self._cut(replace(d, confidence=s[:len(d.tokens)])) for d, s in zip(drafts, scores)]

    def _cut(self, d: Draft) -> Draft:
        """The longest prefix whose every confidence is >= the cut-off (0: the whole draft)."""
        low = np.flatnonzero(d.confidence < self.confidence_cutoff)
        if not len(low):
            return d
        return replace(d, **{f.name: getattr(d, f.name)[:low[0]] for f in fields(d)
                             if getattr(d, f.name) is not None})


def unpack_chain(packed: np.ndarray) -> tuple[np.ndarray, ...]:
    """_block's packed chain [B, D, 4 | 5] -> tokens [B, D], top two probabilities and
    tokens [B, D, 2], confidence [B, D] (float32) or None."""
    scores = packed[..., 4].astype(np.float32) if packed.shape[-1] > 4 else None
    return packed[..., 2], packed[..., 0:2], packed[..., 2:4], scores
