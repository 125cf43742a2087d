"""The drafter's configuration and the table of its checkpoint tensors (torch-free).

Source of truth: vLLM 0.33.0, read in its wheel: `transformers_utils/configs/deepseek_v41.py`
(text fields nested under `text_config`, flattened), `models/deepseek_v41/nvidia/dspark.py`
(the drafter and its `mtp.{j}.*` name remapping), `models/deepseek_v41/nvidia/model.py` and
`models/deepseek_v4/nvidia/model.py` (decoder layer, MoE, shared expert), `models/deepseek_v41/
attention.py`, `models/deepseek_v41/quant_config.py`, `v1/worker/gpu/spec_decode/utils.py`
(the noise token) and `config/speculative.py` (block size). Defaults are vLLM's `getattr`
defaults; a key vLLM reads without a default is required here and refused by name.

DeepSeek-V4 (model_type "deepseek_v4") is served by the same code, as vLLM 0.33.0 computes it
in `models/deepseek_v4/nvidia/dspark.py` and exllamav3 1.6.5 in
`architecture/deepseek_v4_mtp.py`. `Dsv41DrafterConfig` holds the values and reads the keys
both variants read alike; `V41DrafterConfig` and `V4DrafterConfig` hold what differs: the
forward's switches, the Markov factors' names, and a `_read_*` hook per key read differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

HC_POST_ALPHA = 2.0  # DeepseekV4DecoderLayer.hc_post_alpha: a constant, not a config key
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
# Kinds of stored tensors: fp8 = float8_e4m3fn, fp4 = two e2m1 values per byte along the
# input dimension (float4_e2m1fn_x2 / int8), e8m0 = float8_e8m0fnu power-of-two scales.
KINDS = ("bf16", "f32", "fp8", "fp4", "e8m0")
FP4_SCALE_BLOCK = 32  # one e8m0 scale per 32 input values of an fp4 expert weight
_NOISE_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")
DEFAULT_STAGES = 3  # vLLM's DSparkDeepseekV4Model: `n_mtp_layers or 3`


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]  # as stored in the checkpoint (fp4: input dimension halved)
    kind: str               # one of KINDS


class _Keys(dict):
    """The flattened config.json, refusing a missing key by the drafter's name."""

    def __init__(self, flat: dict, name: str):
        super().__init__(flat)
        self.name = name

    def need(self, key: str):
        """A key vLLM reads without a default (null counts as missing)."""
        if self.get(key) is None:
            raise ValueError(f"{self.name} drafter config lacks {key!r}")
        return self[key]

    def given(self, key: str):
        """A key vLLM reads without a default whose value may be null (no clamp, no shared
        expert)."""
        return need_key(self, key, self.name)


@dataclass(frozen=True)
class Dsv41DrafterConfig:
    """The drafter's sizes and storage: the same fields for both variants (the drafter's digest
    covers their `asdict`). `from_json` builds the class config.json's model_type names."""

    hidden_size: int
    vocab_size: int
    num_hidden_layers: int       # the target's; vLLM names drafter layer j layers.{this + j}
    n_mtp_layers: int            # drafter layers (stages): _read_stages
    rms_norm_eps: float
    # mHC: hc_mult copies of the residual stream, Sinkhorn-normalised mixing
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    # attention (compressor-less sliding window, one shared KV row of head_dim)
    num_attention_heads: int
    head_dim: int                # width of each query head and of the shared KV row
    qk_rope_head_dim: int        # the last dims of a head that carry GPT-J RoPE
    q_lora_rank: int             # wq_a: hidden -> q_lora_rank, q_norm, wq_b -> heads*head_dim
    o_groups: int                # wo_a projects each group of heads to o_lora_rank
    o_lora_rank: int
    sliding_window: int          # context rows a block sees: the last min(this, p0)
    rope_theta: float            # plain RoPE on sliding-window layers (no YaRN)
    # MoE (the drafter's expert counts: dspark_* override the target's)
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int        # 0: none; else one shared MLP of this x moe_intermediate_size
    swiglu_limit: float | None   # clamp of the SwiGLU inputs; None: no clamp
    routed_scaling_factor: float
    scoring_func: str
    norm_topk_prob: bool         # renormalise the chosen experts' weights to sum 1
    gate_bias: bool              # topk_method == "noaux_tc": ffn.gate.bias steers the choice
    # DSpark
    target_layer_ids: tuple[int, ...]  # taps: the stream entering these target layers
    block_size: int              # W: [seed, noise x (W-1)] -> W drafts per pass
    markov_rank: int
    noise_token_id: int
    enable_confidence_head: bool  # vLLM drops the head when the checkpoint lacks it
    # checkpoint storage
    expert_dtype: str            # "fp4" (MXFP4 experts) or "fp8" (block-fp8 experts)
    weight_block_size: tuple[int, int]  # fp8 linear scale block (rows, cols)
    vision: bool                 # vision checkpoints add ffn.gate.bias_vl (unused for text)
    variant: str = "v41"         # "v41" (DeepSeek-V4.1) or "v4" (DeepSeek-V4): its class's
    quantized: bool = True       # False: no quantization_config, every linear stored bf16

    # What a variant class sets (class attributes, not fields):
    name: ClassVar[str]           # "DeepSeek-V4.1" / "DeepSeek-V4", in every refusal
    model_type: ClassVar[str]     # config.json's model_type
    delayed_mhc: ClassVar[bool]   # a sublayer's input collapsed with the PREVIOUS one's pre weight
    hc_head: ClassVar[bool]       # a learned hc_head (hc_head_fn/base/scale) collapses the output
    q_head_norm: ClassVar[bool]   # a weightless RMS norm of each query head before RoPE
    markov_factors: ClassVar[tuple[str, str]]  # markov_head.<W1>, markov_head.<W2>

    def __post_init__(self):
        # the switches are the class's, so the variant field must name the class
        if getattr(type(self), "model_type", None) is None or self.variant != type(self).variant:
            raise TypeError(f"{type(self).__name__} with variant {self.variant!r}: a drafter "
                            "config is a V41DrafterConfig or a V4DrafterConfig (from_json picks)")

    @property
    def feature_width(self) -> int:
        """One context row: the taps of every target layer, concatenated in layer order."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def mix_hc(self) -> int:
        """Rows of an hc_*_fn projection: hc pre weights, hc post weights, hc x hc mix."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def rope_head_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def linear_scale_kind(self) -> str:
        """fp8 linear scales: e8m0 in fp4-expert checkpoints, float32 in fp8-expert ones
        (DeepseekV4FP8Config.is_scale_e8m0)."""
        return "e8m0" if self.expert_dtype == "fp4" else "f32"

    @classmethod
    def from_json(cls, config: dict) -> Dsv41DrafterConfig:
        """The whole config.json (text fields under `text_config` or flat), read by the variant
        class its model_type names."""
        flat = flatten(config)
        variant = VARIANT_CLASSES.get(flat.get("model_type"))
        if variant is None or not issubclass(variant, cls):
            known = sorted(t for t, c in VARIANT_CLASSES.items() if issubclass(c, cls))
            raise ValueError(f"model_type {flat.get('model_type')!r}: a DeepSeek drafter's config "
                             f"is one of {known}")
        keys = _Keys(flat, variant.name)
        _refuse_other_layouts(keys)
        return variant(**variant._read_shape(keys), **variant._read_moe(keys),
                       **variant._read_dspark(keys), **variant._read_storage(config, keys))

    # -- what both variants read alike ----------------------------------------------------
    @classmethod
    def _read_shape(cls, keys: _Keys) -> dict:
        """Sizes, mHC and attention."""
        head_dim = int(keys.need("head_dim"))
        return dict(
            hidden_size=int(keys.need("hidden_size")), vocab_size=int(keys.need("vocab_size")),
            num_hidden_layers=int(keys.need("num_hidden_layers")),
            n_mtp_layers=cls._read_stages(keys), rms_norm_eps=float(keys.need("rms_norm_eps")),
            hc_mult=int(keys.need("hc_mult")), hc_eps=float(keys.need("hc_eps")),
            hc_sinkhorn_iters=int(keys.need("hc_sinkhorn_iters")),
            num_attention_heads=int(keys.need("num_attention_heads")),
            head_dim=head_dim, qk_rope_head_dim=cls._read_rope_dims(keys, head_dim),
            q_lora_rank=int(keys.need("q_lora_rank")), o_groups=int(keys.need("o_groups")),
            o_lora_rank=int(keys.need("o_lora_rank")),
            sliding_window=int(keys.need("sliding_window")),
            rope_theta=float(keys.need("rope_theta")))

    @classmethod
    def _read_moe(cls, keys: _Keys) -> dict:
        scoring = keys.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {scoring!r}: one of {SCORING_FUNCS}")
        n_routed, per_token = cls._read_expert_counts(keys)
        swiglu_limit, n_shared = keys.given("swiglu_limit"), keys.given("n_shared_experts")
        return dict(
            n_routed_experts=n_routed, num_experts_per_tok=per_token,
            moe_intermediate_size=int(keys.need("moe_intermediate_size")),
            n_shared_experts=int(n_shared or 0),
            swiglu_limit=None if swiglu_limit is None else float(swiglu_limit),
            routed_scaling_factor=float(cls._read_routed_scaling_factor(keys)),
            scoring_func=scoring, norm_topk_prob=bool(keys.need("norm_topk_prob")),
            gate_bias=keys.get("topk_method") == "noaux_tc")

    @classmethod
    def _read_dspark(cls, keys: _Keys) -> dict:
        # vLLM reads the block size from block_size, then dspark_block_size
        block_size = keys.get("block_size") or keys.need("dspark_block_size")
        return dict(
            target_layer_ids=tuple(int(i) for i in keys.need("dspark_target_layer_ids")),
            block_size=int(block_size), markov_rank=int(keys.need("dspark_markov_rank")),
            noise_token_id=_noise_token_id(keys, keys.name),
            enable_confidence_head=bool(keys.get("enable_confidence_head", True)))

    @classmethod
    def _read_storage(cls, config: dict, keys: _Keys) -> dict:
        expert_dtype = cls._read_expert_dtype(config, keys)
        if expert_dtype not in ("fp4", "fp8"):
            raise ValueError(f"expert_dtype {expert_dtype!r}: fp4 or fp8")
        quant = keys.get("quantization_config")
        block = tuple((quant or {}).get("weight_block_size") or (128, 128))
        return dict(expert_dtype=expert_dtype, weight_block_size=(int(block[0]), int(block[1])),
                    vision=cls._read_vision(config, keys), quantized=quant is not None)

    # -- what each variant reads its own way (V41DrafterConfig, V4DrafterConfig) ----------
    @classmethod
    def _read_stages(cls, keys: _Keys) -> int:
        raise NotImplementedError

    @classmethod
    def _read_rope_dims(cls, keys: _Keys, head_dim: int) -> int:
        return int(keys.need("qk_rope_head_dim"))

    @classmethod
    def _read_expert_counts(cls, keys: _Keys) -> tuple[int, int]:
        return int(keys.need("n_routed_experts")), int(keys.need("num_experts_per_tok"))

    @classmethod
    def _read_routed_scaling_factor(cls, keys: _Keys):
        raise NotImplementedError

    @classmethod
    def _read_expert_dtype(cls, config: dict, keys: _Keys) -> str:
        raise NotImplementedError

    @classmethod
    def _read_vision(cls, config: dict, keys: _Keys) -> bool:
        raise NotImplementedError


@dataclass(frozen=True)
class V41DrafterConfig(Dsv41DrafterConfig):
    """DeepSeek-V4.1's drafter (vLLM 0.33.0's models/deepseek_v41/)."""

    variant: str = "v41"
    name: ClassVar[str] = "DeepSeek-V4.1"
    model_type: ClassVar[str] = "deepseek_v41"
    delayed_mhc: ClassVar[bool] = True   # the last FFN's pre weight collapses the output
    hc_head: ClassVar[bool] = False
    q_head_norm: ClassVar[bool] = False  # "qr is normed before wq_b"
    markov_factors: ClassVar[tuple[str, str]] = ("embed", "head")  # _remap_dspark_name's

    @classmethod
    def _read_stages(cls, keys: _Keys) -> int:
        n_mtp = int(keys.get("n_mtp_layers") or keys.get("num_nextn_predict_layers")
                    or DEFAULT_STAGES)
        _refuse_compressed_drafter_layers(keys.get("compress_ratios"),
                                          int(keys.need("num_hidden_layers")), n_mtp)
        return n_mtp

    @classmethod
    def _read_expert_counts(cls, keys: _Keys) -> tuple[int, int]:
        """The drafter's own counts (dspark_*) over the target's."""
        return (int(keys.get("dspark_n_routed_experts") or keys.need("n_routed_experts")),
                int(keys.get("dspark_num_experts_per_tok") or keys.need("num_experts_per_tok")))

    @classmethod
    def _read_routed_scaling_factor(cls, keys: _Keys):
        return keys.get("routed_scaling_factor", 1.0)

    @classmethod
    def _read_expert_dtype(cls, config: dict, keys: _Keys) -> str:
        return keys.get("expert_dtype", "fp4")  # the text's, else quantization_config's

    @classmethod
    def _read_vision(cls, config: dict, keys: _Keys) -> bool:
        return bool((config.get("vision_config") or {}).get("num_hidden_layers", 0))


@dataclass(frozen=True)
class V4DrafterConfig(Dsv41DrafterConfig):
    """DeepSeek-V4's drafter (vLLM 0.33.0's models/deepseek_v4/, exllamav3 1.6.5), read as
    transformers' DeepseekV4Config: where that has a default for a key missing here, the key
    is still refused by name. Its drafter layers are never compressed (attention.py: ratio 1
    past the trunk), and its taps are the outputs of the listed layers."""

    variant: str = "v4"
    name: ClassVar[str] = "DeepSeek-V4"
    model_type: ClassVar[str] = "deepseek_v4"
    delayed_mhc: ClassVar[bool] = False  # each sublayer's own pre weight
    hc_head: ClassVar[bool] = True
    q_head_norm: ClassVar[bool] = True
    markov_factors: ClassVar[tuple[str, str]] = ("markov_w1", "markov_w2")  # DSparkMarkovHead's

    @classmethod
    def _read_stages(cls, keys: _Keys) -> int:
        """n_mtp_layers, as vLLM reads it (V4 ships num_nextn_predict_layers 1 beside three
        stages: not read); without it, as exllamav3 counts them: compress_ratios has one entry
        per layer, the drafter's past the trunk's; with neither, vLLM's default."""
        if keys.get("n_mtp_layers"):
            return int(keys["n_mtp_layers"])
        past_trunk = len(keys.get("compress_ratios") or ()) - int(keys.need("num_hidden_layers"))
        return past_trunk if past_trunk > 0 else DEFAULT_STAGES

    @classmethod
    def _read_rope_dims(cls, keys: _Keys, head_dim: int) -> int:
        """transformers' DeepseekV4Config: qk_rope_head_dim = head_dim * partial_rotary_factor."""
        factor = keys.get("partial_rotary_factor")
        return int(head_dim * factor) if factor else super()._read_rope_dims(keys, head_dim)

    @classmethod
    def _read_routed_scaling_factor(cls, keys: _Keys):
        # transformers' default (1.5) and exllamav3's (1.0) differ, so it must be given
        return keys.need("routed_scaling_factor")

    @classmethod
    def _read_expert_dtype(cls, config: dict, keys: _Keys) -> str:
        return config.get("expert_dtype", "fp4")  # V4's quant config reads the top level alone

    @classmethod
    def _read_vision(cls, config: dict, keys: _Keys) -> bool:
        return bool(keys.get("vision_n_layers", 0))


VARIANT_CLASSES = {c.model_type: c for c in (V41DrafterConfig, V4DrafterConfig)}


def _refuse_other_layouts(keys: _Keys) -> None:
    """Keys that would make another drafter than DeepSeek's, refused by name."""
    name = keys.name
    if keys.get("sample_from_anchor", True) is not True:
        raise ValueError(f"only sample_from_anchor=true (the seed predicts the first "
                         f"draft) is a {name} DSpark layout")
    vocab = int(keys.need("vocab_size"))
    if (keys.get("draft_vocab_size") or vocab) != vocab:
        raise ValueError(f"a reduced draft vocabulary (draft_vocab_size) is not "
                         f"{name}'s drafter: it shares the target's head")
    if keys.need("hidden_act") != "silu":
        raise ValueError(f"hidden_act {keys['hidden_act']!r}: vLLM's DeepseekV4MLP "
                         "supports silu only")
    if keys.get("dspark_draft_topk") is not None:
        raise ValueError(f"dspark_draft_topk: vLLM 0.33 supports it for Qwen3 DSpark drafters "
                         f"only (config/speculative.py), not {name}'s")


def flatten(config: dict) -> dict:
    """DeepseekV41Config's view: text_config's keys, then the top level's over them, and
    expert_dtype from quantization_config where the text does not name it."""
    flat = dict(config.get("text_config") or {})
    flat.update({k: v for k, v in config.items() if k not in ("text_config", "vision_config")})
    quant = flat.get("quantization_config") or {}
    if "expert_dtype" not in flat and "expert_dtype" in quant:
        flat["expert_dtype"] = quant["expert_dtype"]
    return flat


def need_key(flat: dict, key: str, name: str):
    """A key vLLM reads without a default whose value may be null (no clamp, no shared expert)."""
    if key not in flat:
        raise ValueError(f"{name} drafter config lacks {key!r}")
    return flat[key]


def _noise_token_id(flat: dict, name: str) -> int:
    """vLLM's get_parallel_drafting_token_id order."""
    nested = (flat.get("dflash_config") or {}).get("mask_token_id")
    if nested is not None:
        return int(nested)
    for key in _NOISE_TOKEN_KEYS:
        if flat.get(key) is not None:
            return int(flat[key])
    raise ValueError(f"{name} drafter config lacks 'dspark_noise_token_id' (or "
                     "dflash_config.mask_token_id / mask_token_id / pard_token / ptd_token_id)")


def _refuse_compressed_drafter_layers(ratios, n_layers: int, n_mtp: int) -> None:
    # V4.1's attention.py: compress_ratios has one entry per layer, drafter layers included;
    # those past the list are pure sliding window, the only kind this drafter computes
    for j in range(n_mtp):
        if ratios is not None and n_layers + j < len(ratios) and int(ratios[n_layers + j]):
            raise ValueError(f"compress_ratios gives drafter layer mtp.{j} ratio "
                             f"{ratios[n_layers + j]}: only sliding-window drafter layers "
                             "(ratio 0) are supported")


def first_stage(config: Dsv41DrafterConfig) -> str:
    """The stage holding main_proj / main_norm (vLLM: 'context combiner at mtp.0')."""
    return "mtp.0"


def last_stage(config: Dsv41DrafterConfig) -> str:
    """The stage holding norm / markov_head / confidence_head ('head stack at mtp.last')."""
    return f"mtp.{config.n_mtp_layers - 1}"


def markov_names(config: Dsv41DrafterConfig) -> tuple[str, str]:
    """The Markov head's factors (embedding W1 [V, r], head W2 stored [V, r]): V4.1's checkpoint
    calls them markov_head.embed / head (vLLM's _remap_dspark_name maps them), V4's carries
    DSparkMarkovHead's own names, markov_w1 / markov_w2."""
    stem = f"{last_stage(config)}.markov_head."
    return tuple(f"{stem}{factor}.weight" for factor in config.markov_factors)


def hc_head_names(config: Dsv41DrafterConfig) -> tuple[str, str, str]:
    """V4's learned output collapse (fn [K, K*H], base [K], scale [1]) at the last stage."""
    return tuple(f"{last_stage(config)}.hc_head_{p}" for p in ("fn", "base", "scale"))


def routed_expert(name: str) -> int | None:
    """The routed expert a tensor belongs to (`mtp.<j>.ffn.experts.<e>.*`), else None."""
    parts = name.split(".")
    if len(parts) > 4 and parts[0] == "mtp" and parts[2:4] == ["ffn", "experts"] and parts[4].isdigit():
        return int(parts[4])
    return None


def in_slice(name: str, experts: range | None) -> bool:
    """Whether a rank holding `experts` (None: all) holds tensor `name`."""
    e = routed_expert(name)
    return experts is None or e is None or e in experts


def weight_table(config: Dsv41DrafterConfig,
                 experts: range | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (dequantised shape, storage)}: what the model receives after dequantisation
    (no scale tensors); storage is "bf16", "f32", "fp8" (block-scaled linear) or "expert"
    (fp4 or fp8 per expert_dtype). experts: only these routed experts (an expert-parallel
    rank's slice; None: all)."""
    c = config
    h = c.hidden_size
    embed, head = markov_names(c)
    table = {"embed.weight": ((c.vocab_size, h), "bf16"),
             "head.weight": ((c.vocab_size, h), "bf16"),
             f"{first_stage(c)}.main_proj.weight": ((h, c.feature_width), "fp8"),
             f"{first_stage(c)}.main_norm.weight": ((h,), "bf16"),
             f"{last_stage(c)}.norm.weight": ((h,), "bf16"),
             embed: ((c.vocab_size, c.markov_rank), "bf16"),
             head: ((c.vocab_size, c.markov_rank), "bf16")}
    if c.hc_head:
        fn, base, scale = hc_head_names(c)
        table.update({fn: ((c.hc_mult, c.hc_mult * h), "f32"), base: ((c.hc_mult,), "f32"),
                      scale: ((1,), "f32")})
    if c.enable_confidence_head:
        table[f"{last_stage(c)}.confidence_head.proj.weight"] = ((1, h + c.markov_rank), "f32")
    for j in range(c.n_mtp_layers):
        table.update(layer_table(c, f"mtp.{j}."))
    return {n: v for n, v in table.items() if in_slice(n, experts)}


def linear_names(config: Dsv41DrafterConfig) -> list[str]:
    """The drafter's own linears, which another weight back end may serve (exl3.py):
    main_proj, the attention projections, experts and shared experts; not the router gate,
    nor the embedding, head and Markov/confidence heads."""
    return [n for n, (_, storage) in weight_table(config).items() if storage in ("fp8", "expert")]


def layer_table(config: Dsv41DrafterConfig, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """One DeepseekV4DecoderLayer (sliding-window attention, routed MoE) under `prefix`: a
    drafter stage's layer, or a trunk layer's with the same sizes (tiny.py)."""
    c, p = config, prefix
    h, hc_dim = c.hidden_size, c.hc_mult * c.hidden_size
    heads_width = c.num_attention_heads * c.head_dim
    shared = c.n_shared_experts * c.moe_intermediate_size
    table = {
        p + "attn_norm.weight": ((h,), "bf16"),
        p + "ffn_norm.weight": ((h,), "bf16"),
        p + "attn.wq_a.weight": ((c.q_lora_rank, h), "fp8"),
        p + "attn.q_norm.weight": ((c.q_lora_rank,), "bf16"),
        p + "attn.wq_b.weight": ((heads_width, c.q_lora_rank), "fp8"),
        p + "attn.wkv.weight": ((c.head_dim, h), "fp8"),
        p + "attn.kv_norm.weight": ((c.head_dim,), "bf16"),
        p + "attn.wo_a.weight": ((c.o_groups * c.o_lora_rank, heads_width // c.o_groups), "fp8"),
        p + "attn.wo_b.weight": ((h, c.o_groups * c.o_lora_rank), "fp8"),
        p + "attn.attn_sink": ((c.num_attention_heads,), "f32"),
        p + "ffn.gate.weight": ((c.n_routed_experts, h), "bf16"),
    }
    for mixer in ("hc_attn", "hc_ffn"):
        table[p + f"{mixer}_fn"] = ((c.mix_hc, hc_dim), "f32")
        table[p + f"{mixer}_base"] = ((c.mix_hc,), "f32")
        table[p + f"{mixer}_scale"] = ((3,), "f32")
    if c.gate_bias:
        table[p + "ffn.gate.bias"] = ((c.n_routed_experts,), "f32")
    if c.vision:
        table[p + "ffn.gate.bias_vl"] = ((c.n_routed_experts,), "f32")
    for e in range(c.n_routed_experts):
        q = p + f"ffn.experts.{e}."
        table[q + "w1.weight"] = ((c.moe_intermediate_size, h), "expert")
        table[q + "w3.weight"] = ((c.moe_intermediate_size, h), "expert")
        table[q + "w2.weight"] = ((h, c.moe_intermediate_size), "expert")
    if shared:
        table[p + "ffn.shared_experts.w1.weight"] = ((shared, h), "fp8")
        table[p + "ffn.shared_experts.w3.weight"] = ((shared, h), "fp8")
        table[p + "ffn.shared_experts.w2.weight"] = ((h, shared), "fp8")
    return table


def expected_tensors(config: Dsv41DrafterConfig, experts: range | None = None) -> dict[str, TensorSpec]:
    """Every tensor of the drafter as DeepSeek's checkpoint stores it: {name: (shape, kind)},
    `.scale` tensors included (`<module>.weight` is scaled by `<module>.scale`): fp8 linears
    one scale per weight_block_size block, fp4 experts one e8m0 scale per 32 inputs. Without
    a quantization_config every linear is stored bf16, unscaled. experts: as weight_table."""
    return stored_tensors(config, weight_table(config, experts))


def stored_tensors(config: Dsv41DrafterConfig, table: dict) -> dict[str, TensorSpec]:
    """A weight_table-like table as the checkpoint stores it (see expected_tensors)."""
    rows_block, cols_block = config.weight_block_size
    found = {}
    for name, (shape, storage) in table.items():
        if not config.quantized and storage in ("fp8", "expert"):
            storage = "bf16"
        if storage in ("bf16", "f32"):
            found[name] = TensorSpec(shape, storage)
            continue
        out, inp = shape
        scale = name.removesuffix(".weight") + ".scale"
        if storage == "expert" and config.expert_dtype == "fp4":
            found[name] = TensorSpec((out, inp // 2), "fp4")
            found[scale] = TensorSpec((out, _cdiv(inp, FP4_SCALE_BLOCK)), "e8m0")
        else:  # block-fp8 linear, or an fp8 expert (float32 scales, as its linears)
            found[name] = TensorSpec(shape, "fp8")
            found[scale] = TensorSpec((_cdiv(out, rows_block), _cdiv(inp, cols_block)),
                                      config.linear_scale_kind)
    return found


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
