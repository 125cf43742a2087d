"""DeepSeek-V4.1's (and DeepSeek-V4's) DSpark drafter, forward only, in plain torch: what vLLM
0.33.0 computes (`models/deepseek_v41/nvidia/dspark.py`, `nvidia/model.py`, `attention.py`,
`model_executor/kernels/mhc/torch.py`; V4: `models/deepseek_v4/`, and exllamav3 1.6.5),
assembled from modules that own their weights (modules/), each compared with the float64
reference (tests/dsv41_vllm_transcript.py).

* Context: each layer turns the projected taps into one key/value row per committed position.
* Block: [seed, noise x (W-1)], one non-causal pass over it and the context: W drafts.
* A layer: the mHC mix around attention, then around the MoE (modules/mix.py).
* Heads: the head's logits z, then the Markov head left to right, the confidence head.
Not reproduced: vLLM's FP8 KV cache and low-precision GEMMs. Shapes below: N tokens,
B requests, W block, C context rows, L layers, H hidden, D head_dim, K hc_mult, V vocab.

The full story: ARCHITECTURE.md § DeepSeek-V4.1's drafter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from remote_drafter.models import exl3_dense

from .config import (
    Dsv41DrafterConfig,
    first_stage,
    hc_head_names,
    last_stage,
    markov_names,
    weight_table,
)
from .modules.attention import Attention, unseen_keys
from .modules.heads import ConfidenceHead, Head, MarkovHead
from .modules.inputs import BlockEmbedding, TapProjection
from .modules.mix import HyperMix, OutputCollapse
from .modules.module import Linear, Module, Weights
from .modules.moe import FusedExperts, MoE
from .modules.numerics import Numerics, attention, differs


class DecoderLayer(Module):
    """One drafter layer: the mix around attention, then around the MoE."""

    def __init__(self, numerics: Numerics, weights: Weights, j: int, experts: range):
        super().__init__(numerics)
        prefix = f"mtp.{j}."
        self.attn_mix = HyperMix(numerics, weights, prefix, "attn")
        self.attention = Attention(numerics, weights, prefix)
        self.ffn_mix = HyperMix(numerics, weights, prefix, "ffn")
        self.moe = MoE(numerics, weights, prefix, experts)

    def __call__(self, residual, carried_pre, positions, ctx, unseen):
        """-> (residual, its FFN's pre weight: the next layer's carried_pre)."""
        x, post, comb, attn_pre = self.attn_mix.pre(residual, carried_pre)
        residual = self.attn_mix.post(self.attention(x, positions, ctx, unseen), residual, post, comb)
        x, post, comb, ffn_pre = self.ffn_mix.pre(residual, attn_pre)
        return self.ffn_mix.post(self.moe(x), residual, post, comb), ffn_pre


# how a refusal of our expert kernel begins when it failed on the serving GPU (not the pack)
FAILED_HERE = "it failed on this GPU"


class Dsv41Model(Module):
    """The drafter from (config, {checkpoint name: dequantised tensor}). Bulk weights are
    cast to `dtype` (default: as given); those DeepSeek ships in float32 (mHC, sinks, gate
    bias, confidence head) stay float32, or become float64 with a float64 model."""

    def __init__(self, config: Dsv41DrafterConfig, weights: dict[str, torch.Tensor],
                 device="cpu", dtype: torch.dtype | None = None, linears: dict[str, Linear] | None = None,
                 experts: range | None = None):
        """linears: {weight name: x -> x @ W.T} for weights another back end serves (EXL3:
        exl3.py; wo_a's maps [..., groups, in] -> [..., groups, o_lora_rank]), in place of
        their dense tensors. experts: the routed experts held (an expert-parallel rank's
        slice, whose MoE layers drafter_tp2 joins; None: all)."""
        served = dict(linears or {})
        table = {n: v for n, v in weight_table(config, experts).items() if n not in served}
        confidence = f"{last_stage(config)}.confidence_head.proj.weight"
        if confidence in table and confidence not in weights:  # vLLM drops a missing head
            del table[confidence]
        missing = sorted(set(table) - set(weights))
        if missing:
            raise ValueError(f"{config.name} drafter weights lack {missing[0]!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        numerics = Numerics(config, dtype or weights["embed.weight"].dtype, torch.device(device))
        tensors = {}
        for name, (shape, storage) in table.items():
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the config says {shape}")
            tensors[name] = t.to(numerics.device, numerics.wide if storage == "f32" else numerics.dtype)
        source = Weights(tensors, served)
        super().__init__(numerics)
        self.config, self.served = config, served
        self.embedding = BlockEmbedding(numerics, source)  # first: describe() reads the dtype of the first tensor
        self.taps = TapProjection(numerics, source, first_stage(config))
        held = experts if experts is not None else range(config.n_routed_experts)
        self.layers = [DecoderLayer(numerics, source, j, held) for j in range(config.n_mtp_layers)]
        self.output_collapse = OutputCollapse(numerics, source, hc_head_names(config)) if config.hc_head else None
        self.head = Head(numerics, source, last_stage(config))
        self.markov = MarkovHead(numerics, source, markov_names(config))
        self.confidence = ConfidenceHead(numerics, source, confidence) if confidence in table else None
        self.dense_exl3: list = []  # exl3_dense.Choice of each EXL3 linear holding a dense copy

    @property
    def dtype(self) -> torch.dtype:
        return self.numerics.dtype

    @property
    def device(self) -> torch.device:
        return self.numerics.device

    def parameters(self):
        """The dense weights (Drafter.describe reads the dtype of the first: the embedding)."""
        return (t for _, t in self.named_tensors())

    # -- the forward ---------------------------------------------------------------------
    def encode_rows(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """taps [N, k*H] -> every layer's context rows, concatenated [N, L*D]."""
        main_x = self.taps(taps)
        return torch.cat([layer.attention.context_rows(main_x, positions) for layer in self.layers], -1)

    def block_hidden(self, ctx: torch.Tensor, ctx_valid: torch.Tensor, seed: torch.Tensor,
                     p0: torch.Tensor) -> torch.Tensor:
        """ctx [B, C, L, D], ctx_valid [B, C], seed [B] at p0 [B] -> pre-norm h [B, W, H]."""
        c = self.config
        x, _ = self.embedding(seed)
        positions = p0[:, None] + torch.arange(c.block_size, device=p0.device)
        unseen = unseen_keys(ctx_valid, c.block_size)
        residual = x[..., None, :].expand(*x.shape[:-1], c.hc_mult, x.shape[-1])
        pre = None
        for j, layer in enumerate(self.layers):
            residual, pre = layer(residual, pre, positions, ctx[:, :, j], unseen)
        if self.output_collapse is not None:
            pre = self.output_collapse(residual)
        return self.numerics.collapse(residual, pre)

    # -- which implementations serve -----------------------------------------------------
    def use_kernels(self, on: bool = True) -> str | None:
        """The round's Triton kernels (kernels.py: the hyper-connection mixes, one launch a
        side of each sublayer; RoPE and the RMS norms; the routers; the greedy chain's top two
        over the vocabulary), or (on False) torch, for every module at once. The kernels serve only
        once they have matched torch on this model's own weights and shapes (_probes), on
        this device (a Triton or GPU they break on is refused here, not mid-round). None
        when they serve, else why not. The window's attention takes its kernel where that
        matched torch too, else torch's, beside the others (numerics.attention_refusal says why)."""
        num = self.numerics
        num.kernels, num.attention_refusal = None, None
        if not on:
            return "not asked to"
        if num.wide != torch.float32:
            return f"the kernels compute in float32, this model in {num.wide}"
        try:
            from . import kernels
            torch_path = self._probes()
            num.kernels = kernels
            kernel_path = self._probes()
        except Exception as exc:  # noqa: BLE001 - any failure to build or run them: torch serves
            num.kernels = None
            return f"{type(exc).__name__}: {exc}"
        for name, a in torch_path.items():
            if why := differs(a, kernel_path[name], 0 if name.endswith(("tokens", "experts")) else num.rounding):
                num.kernels = None
                return f"the kernels' {name} {why}"
        num.attention_refusal = self._attention_refusal(kernels)
        return None

    @torch.inference_mode()
    def _attention_refusal(self, kernels, form: dict | None = None) -> str | None:
        """Why the attention kernel (in `form`, one of kernels.ATTEND_VARIANTS) may not serve
        (None: it may): layer 0's attention as a round calls it (a window's context rows, one
        layer's of the windows' strided rows), over a whole context, one half padding and one
        all padding, the kernel against torch."""
        n = self.config.sliding_window
        args = self._attention_args(torch.arange(n) >= torch.tensor([[0], [n // 2], [n]]), seed=1)
        try:
            why = differs(attention(*args, self.numerics.wide), kernels.attend(*args, **(form or {})),
                          self.numerics.rounding)
        except Exception as exc:  # noqa: BLE001 - any failure to build or run it: torch attends
            return f"{type(exc).__name__}: {exc}"
        return why and f"it {why}"

    def _attention_args(self, valid: torch.Tensor, seed: int) -> tuple:
        """Layer 0's attention inputs as a round has them, for len(valid) requests: random
        queries, one layer's of the windows' strided context rows (`valid` [B, window]: which
        hold a committed position), the block's new rows, the keys unseen, the sinks."""
        c, g = self.config, torch.Generator().manual_seed(seed)
        q, windows, new = (torch.randn(len(valid), *shape, generator=g).to(self.device, self.dtype) for shape in (
            (c.block_size, c.num_attention_heads, c.head_dim), (c.sliding_window, c.n_mtp_layers, c.head_dim),
            (c.block_size, c.head_dim)))
        unseen = unseen_keys(valid.to(self.device), c.block_size)
        return q, windows[:, :, 0], new, unseen, self.layers[0].attention.sink

    @torch.inference_mode()
    def choose_attention(self, batches: list[int], timed: Callable[[Callable], float]) -> dict[int, str]:
        """The attention kernel's form at each batch the rounds run: every form of
        kernels.ATTEND_VARIANTS that matches torch (_attention_refusal) timed by `timed` (ms
        of a call of its argument: cuda_graphs.graph_ms) on layer 0's attention at the
        round's shapes, a whole window of context, the fastest serving there (ties: the
        earlier form; a form whose timing raises is passed over). {batch: its form's name}
        (numerics.attend_chosen); nothing changes where the kernel does not serve."""
        from . import kernels
        num = self.numerics
        if num.kernels is None or num.attention_refusal is not None:
            return {}
        forms = {name: form for name, form in kernels.ATTEND_VARIANTS.items()
                 if self._attention_refusal(kernels, form) is None}
        if not forms:  # none matched torch this time: the kernel's defaults serve
            num.attend_chosen = {}
            return {}
        chosen = {}
        for b in batches:
            args = self._attention_args(torch.ones(b, self.config.sliding_window, dtype=torch.bool), seed=2)
            times = {}
            for name, form in forms.items():
                try:
                    times[name] = timed(lambda form=form, args=args: kernels.attend(*args, **form))
                except Exception:  # noqa: BLE001 - a form this GPU cannot capture or run does not serve
                    continue
            chosen[b] = min(times, key=times.get) if times else "default"
        num.attend_chosen = chosen
        return chosen

    @torch.inference_mode()
    def _probes(self) -> dict[str, torch.Tensor]:
        """What use_kernels compares, every kernel on this model's own weights and shapes:
        layer 0's attention and FFN mixes on a fixed random stream (every collapse the
        variant uses), RoPE there and back at positions up to 300K, the norms with and
        without a weight, the top two of random logits and of logits plus a bias, layer 0's
        router on random float32 logits (its chosen experts exactly)."""
        c, num, layer = self.config, self.numerics, self.layers[0]
        g = torch.Generator().manual_seed(0)
        residual = torch.randn(2, c.block_size, c.hc_mult, c.hidden_size, generator=g).to(self.device, self.dtype)
        x, post, comb, pre = layer.attn_mix.pre(residual, None)
        residual = layer.attn_mix.post(x, residual, post, comb)
        out = dict(zip(("attn collapse", "attn post", "attn comb", "attn pre"), (x, post, comb, pre)))
        x, post, comb, pre = layer.ffn_mix.pre(residual, pre)
        out.update(zip(("ffn collapse", "ffn post", "ffn comb", "ffn pre"), (x, post, comb, pre)))
        out["stream"] = layer.ffn_mix.post(x, residual, post, comb)
        q = torch.randn(2, c.block_size, c.num_attention_heads, c.head_dim, generator=g).to(self.device, self.dtype)
        positions = torch.randint(0, 300_000, (2, c.block_size), generator=g).to(self.device)
        out["rope"] = num.rope(q, positions)
        out["rope back"] = num.rope(out["rope"], positions, inverse=True)
        out["norm"] = num.norm(q, None)
        out["weighted norm"] = num.norm(x, layer.attn_mix.norm_weight)
        logits = torch.randn(3, c.vocab_size, generator=g).to(self.device)
        out["top-two probabilities"], out["top-two tokens"] = num.top_two(logits)
        block = torch.randn(3, 2, c.vocab_size, generator=g).to(self.device)  # rows apart, as a round's
        bias = torch.randn(3, c.vocab_size, generator=g).to(self.device, self.dtype)
        out["biased top-two probabilities"], out["biased top-two tokens"] = num.top_two(block[:, 1], bias)
        # float32 logits: no two scores tie, so the chosen experts and their order are the
        # arithmetic's alone (a bf16 product's ties may go either way)
        logits = torch.randn(2 * c.block_size, c.n_routed_experts, generator=g).to(self.device)
        out["routing weights"], out["routed experts"] = layer.moe.routing(logits)
        return out

    def fuse_exl3_experts(self) -> str | None:
        """Every layer's EXL3 experts through exllamav3's fused kernels (modules/moe.py), or
        none of them: None when done, else why not (the per-matrix path stays)."""
        before = [layer.moe.experts for layer in self.layers]
        for layer in self.layers:
            why = layer.moe.fuse(self.device)
            if why:
                for layer, experts in zip(self.layers, before):
                    layer.moe.experts = experts
                return why
        return None

    EXPERT_KERNELS = ("exllamav3", "ours", "auto")

    @torch.inference_mode()
    def choose_expert_kernels(self, row_counts: list[int], mode: str) -> tuple[str, str | None]:
        """Every fused layer's experts on ours or exllamav3's kernels per row count: `mode` as
        REMOTE_DRAFTER_EXL3_EXPERTS says (ours: our kernel's configuration tuned per row count
        on the first layer's own router's choices, in CUDA graphs; auto: then timed against
        exllamav3's there; both the same for every layer: they have the same shapes). Ours
        failing there leaves exllamav3's kernels serving. (what serves, as status says it;
        why ours cannot serve, or None)."""
        if mode not in self.EXPERT_KERNELS:
            raise ValueError(f"REMOTE_DRAFTER_EXL3_EXPERTS={mode!r}: one of {', '.join(self.EXPERT_KERNELS)}")
        fused = [layer for layer in self.layers if isinstance(layer.moe.experts, FusedExperts)]
        if not fused:
            return "not fused", None
        first = fused[0].moe.experts
        chosen = dict.fromkeys(row_counts, False)
        if mode != "exllamav3":
            for layer in fused:
                layer.moe.experts.build_ours()
        if mode != "exllamav3" and first.ours is not None:
            try:  # our kernel compiles on its first call: a GPU or Triton it fails on is found here
                samples = fused[0].moe.routed_samples(row_counts)
                if mode == "auto":
                    chosen = first.faster_ours(samples)
                else:
                    first.ours.tune(samples)
                    chosen = dict.fromkeys(row_counts, True)
            except Exception as exc:  # noqa: BLE001 - exllamav3's kernels serve, and status says why
                for layer in fused:
                    layer.moe.experts.ours = None
                    layer.moe.experts.ours_refusal = f"{FAILED_HERE}: {type(exc).__name__}: {exc}"
        for layer in fused:  # the first layer's choice, or exllamav3's kernels everywhere
            mine = layer.moe.experts
            mine.ours_at = dict(chosen) if first.ours is not None and mine.ours is not None else {}
            if mine.ours_at:
                mine.ours.tuned = dict(first.ours.tuned)
                mine.ours.plan_kernel_at = dict(first.ours.plan_kernel_at)
        return first.describe(), first.ours_refusal

    @property
    def experts_fused(self) -> bool:
        return all(layer.moe.experts.includes_shared for layer in self.layers)

    def dense_candidates(self, block_rows: list[int], encode_rows: list[int]) -> dict[str, tuple]:
        """The EXL3 linears that may hold a dense copy (exl3_dense.py), those outside the
        routed experts (attention, the taps' projection, an EXL3 head, each fused layer's
        shared expert at the row counts exllamav3's kernels run it), each with the row counts
        it runs at: a round's block rows, the encoding's new rows (the taps' projection), or
        both (`wkv`: encode_rows' context_rows)."""
        encoded_only = {id(self.taps.proj)}
        encoded_too = {id(layer.attention.wkv) for layer in self.layers}
        out = {}
        for name, m in self.served.items():
            if ".ffn." in name or not hasattr(m, "keep_dense"):
                continue
            rows = ([] if id(m) in encoded_only else block_rows) + \
                (encode_rows if id(m) in encoded_only | encoded_too else [])
            out[name] = (m, rows)
        for layer in self.layers:
            if (shared := layer.moe.fused_shared()) is not None:  # at the row counts exllamav3's kernels run
                rows = [n for n in block_rows if not layer.moe.experts.ours_serves(n)]
                out[f"{layer.moe.prefix}ffn.shared_experts"] = (shared, rows)
        return out

    def keep_dense_exl3(self, block_rows: list[int], encode_rows: list[int], budget_bytes: int) -> list:
        """dense_candidates hold a dense fp16 copy where it measured faster on this GPU,
        within `budget_bytes` in all (exl3_dense.choose). Copies chosen before stay, and
        serve: another drafter's CUDA graphs may read them."""
        held = sum(c.nbytes for c in self.dense_exl3)
        open_ = {n: (m, rows) for n, (m, rows) in self.dense_candidates(block_rows, encode_rows).items()
                 if m.dense_weight is None}
        self.dense_exl3 += exl3_dense.choose(open_, budget_bytes - held)
        return self.dense_exl3

    def stack_experts(self) -> str | None:
        """Every layer's dense experts stacked, the chosen ones in grouped GEMMs where those
        match (modules/moe.py): None when every layer's are grouped, else the first why not."""
        whys = [layer.moe.stack() for layer in self.layers]
        return next((why for why in whys if why), None)

    def every_expert_on_every_row(self) -> None:
        """Per-matrix experts run on every row: no host read of the routing (graphs)."""
        for layer in self.layers:
            layer.moe.every_expert_on_every_row()
