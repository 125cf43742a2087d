"""DeepSeek-V4.1's (and DeepSeek-V4's) DSpark drafter, forward only, in plain torch: what vLLM
0.33.0 computes (`models/deepseek_v41/nvidia/dspark.py`, `nvidia/model.py`, `attention.py`,
`model_executor/kernels/mhc/torch.py`; V4: `models/deepseek_v4/`, and exllamav3 1.6.5), one
method per stage, each compared with the float64 reference (tests/dsv41_vllm_transcript.py).

* Context: each layer turns the projected taps into one key/value row per committed position.
* Block: [seed, noise x (W-1)], one non-causal pass over it and the context: W drafts.
* mHC: K residual copies, mixed by Sinkhorn-normalised K x K matrices around each sublayer.
* Delayed mHC (V4.1): a sublayer's input is the copies collapsed with the PREVIOUS sublayer's
  pre weight (V4: its own); the last FFN's collapses the output (V4: a learned hc_head).
* Attention: sliding window over [context rows ; block], a sink logit per head; V4 also
  RMS-norms each query head.
* FFN: routed MoE (top-k of score + gate.bias) plus a shared expert, SwiGLU clamped.
* Markov head: logits_i = z_i + W2 W1[x_{i-1}], left to right; confidence head:
  sigmoid(proj [h_i ; W1[x_{i-1}]]).
Not reproduced: vLLM's FP8 KV cache and low-precision GEMMs. Shapes below: N tokens,
B requests, W block, C context rows, L layers, H hidden, D head_dim, K hc_mult, V vocab.

The full story: ARCHITECTURE.md § DeepSeek-V4.1's drafter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from remote_drafter.models import pick

from .config import (
    HC_POST_ALPHA,
    Dsv41DrafterConfig,
    first_stage,
    hc_head_names,
    last_stage,
    markov_names,
    weight_table,
)

_SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
           "softmax": lambda x: x.softmax(-1)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             wide: torch.dtype) -> torch.Tensor:
    h = x.to(wide)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h if weight is None else h * weight.to(wide)).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, dims: int,
         wide: torch.dtype, inverse: bool = False) -> torch.Tensor:
    """GPT-J (interleaved pairs) rotation of x's last `dims` dims; positions broadcast to
    x.shape[:-1]. inverse=True rotates back (the attention output). The cos/sin table is
    float32 whatever x's dtype, as vLLM builds it (DeepseekV4ScalingRotaryEmbedding)."""
    f32 = torch.float32
    angles = positions.to(f32)[..., None] * inv_frequencies(theta, dims, x.device)
    cos, sin = angles.cos().to(wide), angles.sin().to(wide)
    if inverse:
        sin = -sin
    rot = x[..., -dims:].to(wide)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)
    return torch.cat([x[..., :-dims], turned.to(x.dtype)], -1)


def relative_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """The largest difference relative to want's largest value."""
    return float((want.float() - got.float()).abs().max() / want.float().abs().max().clamp(min=1e-30))


def inv_frequencies(theta: float, dims: int, device) -> torch.Tensor:
    """RoPE's inverse frequencies [dims / 2], float32, as vLLM builds them."""
    return 1.0 / theta ** (torch.arange(0, dims, 2, device=device, dtype=torch.float32) / dims)


def swiglu(x: torch.Tensor, w1, w3, w2, limit: float | None) -> torch.Tensor:
    """SiluAndMulWithClamp: silu(min(gate, limit)) * clamp(up, -limit, limit), then down;
    w1, w3, w2 apply the linears (Dsv41Model.linear)."""
    gate, up = w1(x), w3(x)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return w2(F.silu(gate) * up)


def linear_names(config: Dsv41DrafterConfig) -> list[str]:
    """The drafter's own linears, which another weight back end may serve (exl3.py):
    main_proj, the attention projections, experts and shared experts; not the router gate,
    nor the embedding, head and Markov/confidence heads."""
    return [n for n, (_, storage) in weight_table(config).items() if storage in ("fp8", "expert")]


class Dsv41Model:
    """The drafter from (config, {checkpoint name: dequantised tensor}). Bulk weights are
    cast to `dtype` (default: as given); those DeepSeek ships in float32 (mHC, sinks, gate
    bias, confidence head) stay float32, or become float64 with a float64 model."""

    def __init__(self, config: Dsv41DrafterConfig, weights: dict[str, torch.Tensor],
                 device="cpu", dtype: torch.dtype | None = None,
                 linears: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None):
        """linears: {weight name: x -> x @ W.T} for weights another back end serves (EXL3:
        exl3.py; wo_a's maps [..., groups, in] -> [..., groups, o_lora_rank]), in place of
        their dense tensors."""
        self.linears = dict(linears or {})
        table = {n: v for n, v in weight_table(config).items() if n not in self.linears}
        confidence = f"{last_stage(config)}.confidence_head.proj.weight"
        if confidence in table and confidence not in weights:  # vLLM drops a missing head
            del table[confidence]
        missing = sorted(set(table) - set(weights))
        if missing:
            raise ValueError(f"{config.name} drafter weights lack {missing[0]!r}"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
        self.config, self.device = config, torch.device(device)
        self.dtype = dtype or weights["embed.weight"].dtype
        self.wide = torch.float64 if self.dtype == torch.float64 else torch.float32
        self.w = {}
        for name, (shape, storage) in table.items():
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the config says {shape}")
            self.w[name] = t.to(self.device, self.wide if storage == "f32" else self.dtype)
        self.has_confidence = confidence in table
        self.first, self.last = first_stage(config), last_stage(config)
        self.markov_w1, self.markov_w2 = markov_names(config)
        self.stacked: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> experts' w1, w3, w2
        self.every_expert = False  # served experts: all of them on every row (fixed shapes)
        self.grouped = False  # stacked experts: the chosen ones through grouped GEMMs
        self.grouped_why: str | None = "experts not stacked"
        self.fused: dict[int, Callable] = {}  # layer -> its EXL3 experts, shared one included
        self.kernels = None  # kernels.py once use_kernels() took it
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # RoPE's, per device, for the kernels

    @property
    def rounding(self) -> float:
        """How far another order of summation may move a result, relative to its largest
        value: float32 rounding; two bf16 steps in bf16 (what follows a bf16 value inherits them)."""
        return 1e-5 if self.dtype == torch.float32 else 2 ** -6

    def use_kernels(self, on: bool = True) -> str | None:
        """The round's Triton kernels (kernels.py: the hyper-connection mixes, one launch a
        side of each sublayer; RoPE and the RMS norms; the greedy chain's top two
        over the vocabulary), or
        (on False) torch. The kernels serve only once they have matched torch on this model's
        own weights and shapes (_probes), on this device (a Triton or GPU they break on is
        refused here, not mid-round). None when they serve, else why not."""
        self.kernels = None
        if not on:
            return "not asked to"
        if self.wide != torch.float32:
            return f"the kernels compute in float32, this model in {self.wide}"
        try:
            from . import kernels
            torch_path = self._probes()
            self.kernels = kernels
            kernel_path = self._probes()
        except Exception as exc:  # noqa: BLE001 - any failure to build or run them: torch serves
            self.kernels = None
            return f"{type(exc).__name__}: {exc}"
        for name, a in torch_path.items():
            err = relative_error(a, kernel_path[name])
            if not err <= (0 if name.endswith("tokens") else self.rounding):
                self.kernels = None
                return f"the kernels' {name} differs from torch's by {err:.2e} (relative to its largest value)"
        return None

    @torch.inference_mode()
    def _probes(self) -> dict[str, torch.Tensor]:
        """What use_kernels compares, every kernel on this model's own weights and shapes:
        layer 0's attention and FFN mixes on a fixed random stream (every collapse the
        variant uses), RoPE there and back at positions up to 300K, the norms with and
        without a weight, the top two of random logits."""
        c = self.config
        g = torch.Generator().manual_seed(0)
        residual = torch.randn(2, c.block_size, c.hc_mult, c.hidden_size, generator=g).to(self.device, self.dtype)
        x, post, comb, pre = self.hc_pre(0, "attn", residual, None)
        residual = self.hc_post(x, residual, post, comb)
        out = dict(zip(("attn collapse", "attn post", "attn comb", "attn pre"), (x, post, comb, pre)))
        x, post, comb, pre = self.hc_pre(0, "ffn", residual, pre)
        out.update(zip(("ffn collapse", "ffn post", "ffn comb", "ffn pre"), (x, post, comb, pre)))
        out["stream"] = self.hc_post(x, residual, post, comb)
        q = torch.randn(2, c.block_size, c.num_attention_heads, c.head_dim, generator=g).to(self.device, self.dtype)
        positions = torch.randint(0, 300_000, (2, c.block_size), generator=g).to(self.device)
        out["rope"] = self.rope(q, positions)
        out["rope back"] = self.rope(out["rope"], positions, inverse=True)
        out["norm"] = self.norm(q, None)
        out["weighted norm"] = self.norm(x, self._w(0, "attn_norm.weight"))
        logits = torch.randn(3, c.vocab_size, generator=g).to(self.device)
        out["top-two probabilities"], out["top-two tokens"] = self.top_two(logits)
        return out

    def fuse_exl3_experts(self) -> str | None:
        """Every layer's EXL3 experts through exllamav3's fused multi-expert kernels (no host
        read of the routing: a CUDA graph captures the round). None when done, else why not
        (the per-matrix path stays). Once fused, a model stays fused with the same buffers:
        CUDA graphs another drafter captured over this model point into them."""
        if self.fused:
            return None
        from remote_drafter.models.exl3_experts import layer_experts
        c = self.config
        try:
            self.fused = {j: layer_experts(self.linears, j, c.n_routed_experts, c.num_experts_per_tok,
                                           bool(c.n_shared_experts), c.swiglu_limit, self.device)
                          for j in range(c.n_mtp_layers)}
        except (KeyError, ValueError, ImportError, AttributeError, RuntimeError) as exc:
            self.fused = {}
            return f"{type(exc).__name__}: {exc}"
        return None

    def stack_experts(self) -> str | None:
        """Every layer's dense experts as [experts, out, in] tensors (moved, not copied), so
        moe() runs them with shapes fixed by the batch: what a CUDA graph can capture (the
        chosen-experts loop reads the routing on the host). Each row's chosen experts then run
        as three grouped GEMMs (torch._grouped_mm: only the chosen experts' weights read) once
        those have matched every expert on every row on this model's first layer; else every
        expert runs on every row. None when grouped, else why not."""
        if self.stacked:
            return self.grouped_why
        for j in range(self.config.n_mtp_layers):
            names = [[f"mtp.{j}.ffn.experts.{e}.{n}.weight" for e in range(self.config.n_routed_experts)]
                     for n in ("w1", "w3", "w2")]
            if any(name in self.linears for group in names for name in group):
                raise ValueError("stacked experts need dense expert weights (another back end serves these)")
            self.stacked[j] = tuple(torch.stack([self.w.pop(name) for name in group]) for group in names)
        self.grouped_why = self._try_grouped()
        self.grouped = self.grouped_why is None
        return self.grouped_why

    @torch.inference_mode()
    def _try_grouped(self) -> str | None:
        c = self.config
        if self.device.type == "cuda" and self.dtype != torch.bfloat16:
            # torch's grouped GEMM serves other dtypes by a path that reads the groups on the
            # host, which a CUDA graph cannot hold
            return f"grouped GEMMs on CUDA take bf16, this model is {self.dtype}"
        rows = torch.randn(2 * c.block_size, c.hidden_size, generator=torch.Generator().manual_seed(0))
        flat = rows.to(self.device, self.dtype)
        weights, experts = self.route(0, flat)
        try:
            want = self._all_experts_stacked(0, flat, weights, experts)
            got = self._chosen_experts_grouped(0, flat, weights, experts)
            if self.device.type == "cuda":  # and inside a graph, as a round runs them
                got = self._captured(lambda: self._chosen_experts_grouped(0, flat, weights, experts))
        except Exception as exc:  # noqa: BLE001 - a torch or device without grouped GEMMs
            return f"{type(exc).__name__}: {exc}"
        err = relative_error(want, got)
        if not err <= self.rounding:
            return f"grouped GEMMs differ from every expert on every row by {err:.2e}"
        return None

    def _captured(self, fn) -> torch.Tensor:
        """fn() captured in a CUDA graph on a side stream and replayed: its output then."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()  # warm-up before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = fn()
        graph.replay()
        torch.cuda.synchronize(self.device)
        return out.clone()

    def parameters(self):
        """The weights (Drafter.describe reads the dtype of the first: the embedding)."""
        return iter([*self.w.values(), *(t for group in self.stacked.values() for t in group)])

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """rms_norm with this model's eps and arithmetic (a kernel where they serve)."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps, self.wide)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., D] at positions [...] (x.shape[:-1], or x.shape[:-2]: one position shared
        by a row's heads), its last qk_rope_head_dim dims rotated (a kernel where they serve)."""
        c = self.config
        if self.kernels is not None:
            inv_freq = self._inv_freq.get(x.device)
            if inv_freq is None:  # made once (a graph's warm-up runs before its capture)
                inv_freq = self._inv_freq[x.device] = inv_frequencies(c.rope_theta, c.qk_rope_head_dim, x.device)
            return self.kernels.rope(x, positions, inv_freq, inverse)
        if positions.dim() < x.dim() - 1:
            positions = positions[..., None]
        return rope(x, positions, c.rope_theta, c.qk_rope_head_dim, self.wide, inverse)

    def _w(self, j: int, rest: str) -> torch.Tensor:
        return self.w[f"mtp.{j}.{rest}"]

    def linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T for the weight `name`: the one place a linear is applied."""
        served = self.linears.get(name)
        return served(x) if served is not None else x @ self.w[name].T

    def _linear(self, j: int, rest: str):
        return lambda x: self.linear(f"mtp.{j}.{rest}", x)

    # -- context -------------------------------------------------------------------------
    def project_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [N, k*H] -> main_x [N, H]: main_norm(main_proj(taps))."""
        x = self.linear(f"{self.first}.main_proj.weight", taps.to(self.dtype))
        return self.norm(x, self.w[f"{self.first}.main_norm.weight"])

    def context_rows(self, j: int, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer j's key/value rows [N, D] (post kv_norm and RoPE) of the context (main_x)
        or of its block input (x)."""
        kv = self.norm(self._linear(j, "attn.wkv.weight")(main_x), self._w(j, "attn.kv_norm.weight"))
        return self.rope(kv, positions)

    def encode_rows(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """taps [N, k*H] -> every layer's rows, concatenated [N, L*D]."""
        main_x = self.project_taps(taps)
        return torch.cat([self.context_rows(j, main_x, positions)
                          for j in range(self.config.n_mtp_layers)], -1)

    # -- the parallel pass ---------------------------------------------------------------
    def embed_block(self, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """seed [B] -> (embeddings [B, W, H], block ids [B, W]: the seed, then noise)."""
        c = self.config
        ids = torch.full((len(seed), c.block_size), c.noise_token_id, device=seed.device)
        ids[:, 0] = seed
        return self.w["embed.weight"][ids], ids

    def _mixes(self, fn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """fn . x * rsqrt(mean(x^2) + eps) over the whole stream x [..., K*H], in `wide`."""
        x = residual.flatten(-2).to(self.wide)
        return (x @ fn.T) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)

    def hc_pre(self, j: int, mixer: str, residual: torch.Tensor, carried_pre: torch.Tensor | None):
        """Mixer "attn" or "ffn" of layer j on residual [..., K, H] -> (the sublayer's normed
        input [..., H], post [..., K], comb [..., K, K], pre [..., K]); carried_pre is the
        previous sublayer's pre (None: layer 0's attention, which takes copy 0)."""
        c, k = self.config, self.config.hc_mult
        fn, scale, base = (self._w(j, f"hc_{mixer}_{p}") for p in ("fn", "scale", "base"))
        norm = self._w(j, f"{mixer}_norm.weight")
        if self.kernels is not None:
            kernels = self.kernels
            collapse = (kernels.COLLAPSE_OWN if not c.delayed_mhc else
                        kernels.COLLAPSE_FIRST if carried_pre is None else kernels.COLLAPSE_CARRIED)
            raw = residual.flatten(-2).to(self.wide) @ fn.T
            return kernels.hc_pre(residual, raw, scale, base, carried_pre, collapse, norm, c.rms_norm_eps,
                                  c.hc_eps, HC_POST_ALPHA, c.hc_sinkhorn_iters)
        mixes = self._mixes(fn, residual)
        pre = torch.sigmoid(mixes[..., :k] * scale[0] + base[:k]) + c.hc_eps
        post = torch.sigmoid(mixes[..., k:2 * k] * scale[1] + base[k:2 * k]) * HC_POST_ALPHA
        comb = mixes[..., 2 * k:].unflatten(-1, (k, k)) * scale[2] + base[2 * k:].view(k, k)
        comb = comb.softmax(-1) + c.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):  # Sinkhorn: rows, then columns
            comb = comb / (comb.sum(-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + c.hc_eps)
        collapse_with = carried_pre if c.delayed_mhc else pre  # V4: no delay
        collapsed = residual[..., 0, :] if collapse_with is None else self.collapse(residual, collapse_with)
        return rms_norm(collapsed, norm, c.rms_norm_eps, self.wide), post, comb, pre

    def hc_post(self, out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
        """residual = comb^T residual + post x out."""
        if self.kernels is not None:
            return self.kernels.hc_post(out, residual, post, comb)
        mixed = torch.einsum("...ij,...ih->...jh", comb, residual.to(self.wide))
        return (mixed + post[..., None] * out[..., None, :].to(self.wide)).to(residual.dtype)

    def collapse(self, residual: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """residual [..., K, H] weighted by pre [..., K] -> [..., H]."""
        return (pre[..., None] * residual.to(self.wide)).sum(-2).to(residual.dtype)

    def head_pre(self, residual: torch.Tensor) -> torch.Tensor:
        """V4's hc_head: the output copies' collapse weights, learned (hc_head_fn/base/scale)."""
        fn, base, scale = (self.w[n] for n in hc_head_names(self.config))
        return torch.sigmoid(self._mixes(fn, residual) * scale[0] + base) + self.config.hc_eps

    def attention(self, j: int, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                  ctx_valid: torch.Tensor) -> torch.Tensor:
        """x [B, W, H] at positions [B, W] over ctx [B, C, D] (ctx_valid [B, C]) and the
        block's own rows -> [B, W, H]."""
        c = self.config
        b, w, _ = x.shape
        heads, d, groups = c.num_attention_heads, c.head_dim, c.o_groups
        qr = self.norm(self._linear(j, "attn.wq_a.weight")(x), self._w(j, "attn.q_norm.weight"))
        q = self._linear(j, "attn.wq_b.weight")(qr).view(b, w, heads, d)
        if c.q_head_norm:
            q = self.norm(q, None)
        q = self.rope(q, positions)
        keys = torch.cat([ctx.to(x.dtype), self.context_rows(j, x, positions)], 1)  # [B, C+W, D]
        scores = torch.einsum("bwhd,bkd->bhwk", q.to(self.wide), keys.to(self.wide)) * d ** -0.5
        seen = torch.cat([ctx_valid, ctx_valid.new_ones(b, w)], 1)  # the whole block, both ways
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        sink = self._w(j, "attn.attn_sink").view(1, heads, 1, 1).expand(b, heads, w, 1)
        probs = torch.cat([scores, sink.to(self.wide)], -1).softmax(-1)[..., :-1]
        o = torch.einsum("bhwk,bkd->bwhd", probs, keys.to(self.wide)).to(x.dtype)
        o = self.rope(o, positions, inverse=True)
        o = o.reshape(b, w, groups, -1)
        name = f"mtp.{j}.attn.wo_a.weight"
        if name in self.linears:
            z = self.linears[name](o)
        else:
            z = torch.einsum("bwgi,goi->bwgo", o, self.w[name].view(groups, c.o_lora_rank, -1))
        return self._linear(j, "attn.wo_b.weight")(z.flatten(-2))

    def route(self, j: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (routing weights [N, top-k] in `wide`, chosen experts [N, top-k])."""
        c = self.config
        scores = _SCORES[c.scoring_func]((x @ self._w(j, "ffn.gate.weight").T).to(self.wide))
        choose = scores + self._w(j, "ffn.gate.bias") if c.gate_bias else scores
        experts = choose.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(-1, experts)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * c.routed_scaling_factor, experts

    def moe(self, j: int, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(j, flat)
        if j in self.fused:  # its output lives in the layer's buffers: copied out here
            return self.fused[j](flat, weights, experts).to(x.dtype, copy=True).view_as(x)
        if j in self.stacked and self.grouped:
            out = self._chosen_experts_grouped(j, flat, weights, experts)
        elif j in self.stacked:
            out = self._all_experts_stacked(j, flat, weights, experts)
        elif self.every_expert:
            out = self._all_experts_one_by_one(j, flat, weights, experts)
        else:
            out = self._chosen_experts_only(j, flat, weights, experts)
        if c.n_shared_experts:
            w1, w3, w2 = (self._linear(j, f"ffn.shared_experts.{n}.weight") for n in ("w1", "w3", "w2"))
            out += swiglu(flat, w1, w3, w2, c.swiglu_limit).to(self.wide)
        return out.to(x.dtype).view_as(x)

    def _all_experts_stacked(self, j: int, flat, weights, experts) -> torch.Tensor:
        """Every expert on every row, weighted by its routing weight (zero where not chosen)."""
        w1, w3, w2 = self.stacked[j]
        share = self._dense_routing(flat, weights, experts)
        y = swiglu(flat, lambda x: torch.einsum("th,eih->eti", x, w1),
                   lambda x: torch.einsum("th,eih->eti", x, w3),
                   lambda a: torch.einsum("eti,ehi->eth", a, w2), self.config.swiglu_limit)
        return torch.einsum("eth,te->th", y.to(self.wide), share)

    def _chosen_experts_grouped(self, j: int, flat, weights, experts) -> torch.Tensor:
        """Each row through its chosen experts only: the (row, expert) slots sorted by expert
        on the device, three grouped GEMMs over the stacked weights (group e: expert e's
        rows), the results put back in slot order and summed per row in a fixed order."""
        w1, w3, w2 = self.stacked[j]
        n, k = experts.shape
        order = experts.flatten().argsort(stable=True)
        counts = torch.zeros(self.config.n_routed_experts, dtype=torch.int32, device=flat.device)
        counts.index_add_(0, experts.flatten(), torch.ones_like(order, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)

        def grouped(w):
            return lambda x: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        y = swiglu(flat[order // k], grouped(w1), grouped(w3), grouped(w2), self.config.swiglu_limit)
        slots = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)
        return torch.einsum("tkh,tk->th", slots.to(self.wide), weights)

    def _dense_routing(self, flat, weights, experts) -> torch.Tensor:
        """[rows, experts]: each row's routing weight of every expert, zero where not chosen."""
        share = torch.zeros(flat.shape[0], self.config.n_routed_experts, dtype=self.wide, device=flat.device)
        return share.scatter_(1, experts, weights)

    def _all_experts_one_by_one(self, j: int, flat, weights, experts) -> torch.Tensor:
        """_all_experts_stacked for experts another back end serves (EXL3: no stacked tensor), one
        expert at a time: no host read of the routing, so a CUDA graph captures it."""
        c = self.config
        share = self._dense_routing(flat, weights, experts)
        out = torch.zeros(flat.shape, dtype=self.wide, device=flat.device)
        for e in range(c.n_routed_experts):
            w1, w3, w2 = (self._linear(j, f"ffn.experts.{e}.{n}.weight") for n in ("w1", "w3", "w2"))
            out += swiglu(flat, w1, w3, w2, c.swiglu_limit).to(self.wide) * share[:, e, None]
        return out

    def _chosen_experts_only(self, j: int, flat, weights, experts) -> torch.Tensor:
        """Each chosen expert on the rows that chose it (reads the routing on the host)."""
        c = self.config
        out = torch.zeros(flat.shape, dtype=self.wide, device=flat.device)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            w1, w3, w2 = (self._linear(j, f"ffn.experts.{e}.{n}.weight") for n in ("w1", "w3", "w2"))
            y = swiglu(flat[rows], w1, w3, w2, c.swiglu_limit)
            out[rows] += y.to(self.wide) * weights[rows, slot, None]  # a token picks e once
        return out

    def layer(self, j: int, residual, carried_pre, positions, ctx, ctx_valid):
        """One decoder layer -> (residual, its FFN's pre weight: the next layer's carried_pre)."""
        x, post, comb, attn_pre = self.hc_pre(j, "attn", residual, carried_pre)
        residual = self.hc_post(self.attention(j, x, positions, ctx, ctx_valid), residual, post, comb)
        x, post, comb, ffn_pre = self.hc_pre(j, "ffn", residual, attn_pre)
        return self.hc_post(self.moe(j, x), residual, post, comb), ffn_pre

    def block_hidden(self, ctx: torch.Tensor, ctx_valid: torch.Tensor, seed: torch.Tensor,
                     p0: torch.Tensor) -> torch.Tensor:
        """ctx [B, C, L, D], ctx_valid [B, C], seed [B] at p0 [B] -> pre-norm h [B, W, H]."""
        c = self.config
        x, _ = self.embed_block(seed)
        positions = p0[:, None] + torch.arange(c.block_size, device=p0.device)
        residual = x[..., None, :].expand(*x.shape[:-1], c.hc_mult, x.shape[-1])
        pre = None
        for j in range(c.n_mtp_layers):
            residual, pre = self.layer(j, residual, pre, positions, ctx[:, :, j], ctx_valid)
        return self.collapse(residual, self.head_pre(residual) if c.hc_head else pre)

    # -- heads ---------------------------------------------------------------------------
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> z [..., V] in `wide`: the target's head over norm(h)."""
        normed = self.norm(h, self.w[f"{self.last}.norm.weight"])
        return self.linear("head.weight", normed).to(self.wide)

    def top_two(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] -> (the two likeliest tokens' probabilities [B, 2], the tokens [B, 2]):
        a greedy draft is the first."""
        return self.kernels.top_two(logits) if self.kernels is not None else pick.top_two(logits)

    def markov_embed(self, previous: torch.Tensor) -> torch.Tensor:
        return self.w[self.markov_w1][previous]

    def markov_bias(self, m: torch.Tensor) -> torch.Tensor:
        return (m @ self.w[self.markov_w2].T).to(self.wide)

    def markov_logits(self, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return z + self.markov_bias(m)

    def confidence(self, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """h [B, H], m [B, r] -> [B] in (0, 1)."""
        proj = self.w[f"{self.last}.confidence_head.proj.weight"]
        return torch.sigmoid(torch.cat([h, m], -1).to(self.wide) @ proj.T)[..., 0]
