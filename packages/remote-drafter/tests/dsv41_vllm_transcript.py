"""An independent float64 reference of one DSpark draft block of DeepSeek-V4.1's drafter, and of
DeepSeek-V4's (config model_type "deepseek_v4"): a literal transcription of vLLM 0.33.0's
forward, read in its wheel, kept apart from remote_drafter.models.dsv41.model so that the two can
check each other (tests/test_dsv41_reference.py).

Inputs are the raw config.json (text fields under `text_config` or flat, read here with vLLM's
getattr defaults) and {checkpoint name: dequantised tensor} (`embed.weight`, `head.weight`,
`mtp.{j}.*`). Everything is float64 but RoPE's cos/sin table, which vLLM builds in float32
(DeepseekV4ScalingRotaryEmbedding keeps it "as fp32 for higher precision RoPE"). One stage a
function; `draft_block` composes them. Where V4.1 in vLLM 0.33.0 is easy to get wrong:

* no per-head RMS norm of the query in V4.1 (DeepSeek-V4 has one): every V4.1 path passes
  apply_q_norm / enable_q_norm = False ("qr is normed before wq_b");
* the mHC is "delayed": a sublayer's input is collapsed with the pre-mix of the sublayer
  before it (stream 0 for the first attention), and the pre-mix it computes goes to the next;
  the last FFN's pre-mix collapses the output;
* with dspark_draft_topk set, the NVIDIA drafter has no apply_markov_bias_gathered (the
  speculator would fail), so only dense drafting is transcribed.

Where DeepSeek-V4 (vllm/models/deepseek_v4/, the DSpark path of the V2 runner) differs:

* the mHC is not delayed: DeepseekV4DecoderLayer.forward runs mhc_pre_tilelang /
  mhc_fused_post_pre_tilelang, whose eager reference mhc_pre_torch collapses a sublayer's
  input with the pre-mix its own mixer computes;
* the output copies are collapsed by a learned hc_head (hc_head_fused_kernel_tilelang ->
  hc_head_fuse_tilelang: sigmoid(mixes * scale + base) + hc_eps over the RMS-scaled stream);
* each query head is RMS-normed without a weight before RoPE, eps rms_norm_eps
  (_fused_qnorm_rope_kv_insert: "per-head RMSNorm (no weight) + GPT-J RoPE"; the op is
  compiled, its text is that comment; exllamav3 1.6.5's modules/arch_specific/dspark.py
  DSparkAttention.forward passes a weight of ones to its fused norm+rope);
* the Markov factors are DSparkMarkovHead's own names, markov_head.markov_w1 / markov_w2
  (_remap_dspark_name has no embed/head mapping);
* the drafter's MoE takes the target's expert counts (DeepseekV4MoE built without
  n_routed_experts; load_weights maps config.n_routed_experts experts);
* n_mtp_layers or 3 stages (num_nextn_predict_layers is not read), never compressed
  (DeepseekV4Attention.__init__: compress_ratio 1 past num_hidden_layers);
* a tap is the mean of the hc copies of the OUTPUT of a listed layer
  (DeepseekV4Model.forward captures after layer idx when idx + 1 is an aux id, and
  get_eagle3_aux_layers_from_config adds 1 for every model type but deepseek_v41);
* the config is transformers' DeepseekV4Config (flat, qk_rope_head_dim = head_dim x
  partial_rotary_factor when that is given).

Transcribed (vLLM 0.33.0 wheel: file::qualified name, then remote_drafter.vllm.versions.source_digest
of the function's source; tools/check-vllm-hooks.py fails when one changes):

  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4Model.__init__  ef74008c628772df
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4Model.combine_hidden_states  66046d35e77ca833
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4Model.precompute_and_store_context_kv  7fb5a12dbf91cf32
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4Model.forward  a552e1815ca98865
  vllm/models/deepseek_v41/nvidia/dspark.py::_insert_context_kv  96bce8d360066cae
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.compute_logits  b001fd3cc669115d
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.markov_embed  db8523ac05d8dc23
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.markov_bias  6704ed0c367fa0db
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.compute_confidence  2f6974f952b26f6f
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.load_weights  b6fc2982cf39fd9d
  vllm/models/deepseek_v41/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM._remap_dspark_name  5d753cb78159e6fa
  vllm/models/deepseek_v41/nvidia/model.py::DeepseekV4MoE.__init__  767f8482793b184b
  vllm/models/deepseek_v41/nvidia/model.py::DeepseekV4DecoderLayer.__init__  808a3c24ae03aeac
  vllm/models/deepseek_v41/nvidia/model.py::DeepseekV4DecoderLayer.forward  5acb6526b8cbcda0
  vllm/models/deepseek_v41/nvidia/ops/mhc.py::mhc_shifted_post_pre  d34c8647593622d7
  vllm/models/deepseek_v41/attention.py::DeepseekV4Attention.__init__  407a6f462e693ab4
  vllm/models/deepseek_v41/attention.py::DeepseekV4Attention.forward  837afca910d5a9c9
  vllm/models/deepseek_v41/attention.py::DeepseekV4Attention._split_qkv_and_norm  b008489a25fe62b2
  vllm/models/deepseek_v41/attention.py::DeepseekV4Attention._fused_qnorm_rope_kv_insert  7eb94b8afcd21d4c
  vllm/models/deepseek_v41/nvidia/flashmla.py::DeepseekV4FlashMLAAttention._o_proj  86b58434855b4f55
  vllm/models/deepseek_v41/nvidia/flashmla.py::DeepseekV4FlashMLAAttention._forward_decode  82ad0816fae3e90e
  vllm/models/deepseek_v41/nvidia/ops/o_proj.py::dsv41_o_proj  a233c19442e32464
  vllm/models/deepseek_v4/nvidia/ops/o_proj.py::deep_gemm_fp8_o_proj  f6424f3ec1241e9d
  vllm/models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py::FusedInvRopeFP8QuantKernel.kernel  264a9a2b7de993bd
  vllm/models/deepseek_v41/common/rope.py::build_deepseek_v4_rope  ce5ab22bea395385
  vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py::DeepseekScalingRotaryEmbedding._compute_inv_freq  db7d5fb618c1478c
  vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py::DeepseekV4ScalingRotaryEmbedding._compute_cos_sin_cache  199648ae5bf92274
  vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py::DeepseekV4ScalingRotaryEmbedding.forward_native  2087d940a106cb79
  vllm/model_executor/layers/rotary_embedding/common.py::rotate_gptj  c29108986e116283
  vllm/model_executor/layers/rotary_embedding/common.py::yarn_find_correction_dim  e11d187a3e97d8a6
  vllm/model_executor/layers/rotary_embedding/common.py::yarn_find_correction_range  00ca5f60c9d56207
  vllm/model_executor/layers/rotary_embedding/common.py::yarn_linear_ramp_mask  7d3e9919660341f8
  vllm/model_executor/layers/rotary_embedding/__init__.py::get_rope  49eec6088479df13
  vllm/model_executor/kernels/mhc/torch.py::mhc_pre_delayed_torch  f1aa0277d1376ce1
  vllm/model_executor/kernels/mhc/torch.py::mhc_post_torch  bbec60ee0e5b88a4
  vllm/model_executor/kernels/mhc/tilelang.py::mhc_pre_delayed_tilelang  9cbe423a7f768791
  vllm/model_executor/kernels/mhc/tilelang.py::mhc_fused_post_pre_delayed_tilelang  215e60265070b0ea
  vllm/model_executor/kernels/mhc/tilelang.py::mhc_post_tilelang  b73625285da8c98d
  vllm/model_executor/kernels/mhc/tilelang_kernels.py::mhc_pre_big_fuse_with_norm_tilelang  82012dc8b4d10704
  vllm/model_executor/kernels/mhc/tilelang_kernels.py::mhc_post_tilelang  b9352dbbe536d4c1
  vllm/model_executor/kernels/mhc/tilelang_kernels.py::hc_prenorm_gemm_tilelang  bcf700d80a44e55d
  vllm/model_executor/kernels/mhc/triton.py::hc_collapse_triton  d98391f1100386f4
  vllm/model_executor/kernels/mhc/triton.py::_hc_head_reduce_store_kernel  8e0858185148a74f
  vllm/models/deepseek_v4/nvidia/model.py::DeepseekV4MLP.forward  ebed16f10ed589a0
  vllm/models/deepseek_v4/nvidia/model.py::DeepseekV4MoE.__init__  ba01e8eff64ee99f
  vllm/model_executor/layers/fused_moe/router/dsv4_topk.py::_dsv4_topk_kernel  2042c6828ec451cd
  vllm/model_executor/layers/fused_moe/router/fused_topk_bias_router.py::fused_topk_bias  32a62364641d70f7
  vllm/model_executor/layers/fused_moe/runner/moe_runner.py::MoERunner._maybe_apply_routed_scale_to_output  16e770fb706242db
  vllm/model_executor/layers/fused_moe/utils.py::_swiglu_limit_torch  dd6e42d82f444937
  vllm/model_executor/layers/activation.py::SiluAndMulWithClamp.forward_native  6606b05809a9178c
  vllm/ir/ops/layernorm.py::rms_norm  aa08e73ba1808c43
  vllm/models/common/ops/fused_qk_rmsnorm.py::FusedQKVRMSNormKernel.kernel  0ddef8dc94d9cf8e
  vllm/v1/attention/ops/rocm_aiter_mla_sparse.py::_sparse_attn_prefill_ragged_kernel  f2670c4c5aa338f0
  vllm/v1/attention/backends/mla/sparse_swa.py::ComputeDSparkNoncausalSWAIndicesKernel.kernel  729d5f761e5a7a70
  vllm/model_executor/models/qwen3_dspark.py::DSparkMarkovHead.embed  a124ac48a88a7ca3
  vllm/model_executor/models/qwen3_dspark.py::DSparkMarkovHead.bias  3f50acaf2cab2aed
  vllm/model_executor/models/qwen3_dspark.py::DSparkConfidenceHead.forward  f9b027daaaa047b5
  vllm/v1/worker/gpu/spec_decode/dspark/speculator.py::DSparkSpeculator._sample_sequential  28da5206e5dbe58c
  vllm/v1/worker/gpu/spec_decode/dflash/speculator.py::_prepare_dflash_inputs_kernel  e898dff011af00ef
  vllm/v1/worker/gpu/spec_decode/utils.py::get_parallel_drafting_token_id  dbf4c973baa1a34d
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4Model.__init__  cda420ae3dc6d4a8
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4Model.combine_hidden_states  66046d35e77ca833
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4Model.precompute_and_store_context_kv  879a04a46cdc77c8
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4Model.forward  46b6b74573d149a0
  vllm/models/deepseek_v4/nvidia/dspark.py::_duplicate_context_wkv_weights  38e4f2eed030cf80
  vllm/models/deepseek_v4/nvidia/dspark.py::_insert_context_kv  23ea15ea4a501b69
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.compute_logits  b001fd3cc669115d
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.markov_embed  db8523ac05d8dc23
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.markov_bias  6704ed0c367fa0db
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.compute_confidence  2f6974f952b26f6f
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM.load_weights  087ddce291e48f16
  vllm/models/deepseek_v4/nvidia/dspark.py::DSparkDeepseekV4ForCausalLM._remap_dspark_name  c3570c04f6788332
  vllm/models/deepseek_v4/nvidia/model.py::DeepseekV4DecoderLayer.__init__  bc042cbf6d2563d7
  vllm/models/deepseek_v4/nvidia/model.py::DeepseekV4DecoderLayer.forward  063ce31ff7a2dc53
  vllm/models/deepseek_v4/nvidia/model.py::DeepseekV4Model.forward  ec9f9b775f010762
  vllm/models/deepseek_v4/attention.py::DeepseekV4Attention.__init__  126ad7f878f947f4
  vllm/models/deepseek_v4/attention.py::DeepseekV4Attention.forward  f6cb1b89b5a9524e
  vllm/models/deepseek_v4/attention.py::DeepseekV4Attention._split_qkv_and_norm  7cbd0809489969f7
  vllm/models/deepseek_v4/attention.py::DeepseekV4Attention._fused_qnorm_rope_kv_insert  9e316b70e1fde9fb
  vllm/models/deepseek_v4/nvidia/flashmla.py::DeepseekV4FlashMLAAttention._o_proj  06c31b0a411d8d0b
  vllm/models/deepseek_v4/common/rope.py::build_deepseek_v4_rope  cd4dde327e8613a9
  vllm/model_executor/kernels/mhc/torch.py::mhc_pre_torch  8c6a66de0dd0c2c6
  vllm/model_executor/kernels/mhc/tilelang.py::mhc_pre_tilelang  4e87ca1ff87c6ee8
  vllm/model_executor/kernels/mhc/tilelang.py::mhc_fused_post_pre_tilelang  19ed5cd49118fcef
  vllm/model_executor/kernels/mhc/tilelang.py::hc_head_fused_kernel_tilelang  db8de18495f4278a
  vllm/model_executor/kernels/mhc/tilelang_kernels.py::hc_head_fuse_tilelang  9887909cb366aa7f
  vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config  328f40b4ec461ab0
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

F64 = torch.float64
HC_POST_MULT = 2.0  # DeepseekV4DecoderLayer.__init__: self.hc_post_alpha = 2.0


# -- config: the attributes vLLM reads, with its getattr defaults --------------------------

def text_config(config: dict) -> dict:
    """transformers_utils/configs/deepseek_v41.py DeepseekV41Config.__init__: text_config's keys
    flattened onto the top level (whose own keys are set after them). DeepSeek-V4's
    (transformers' DeepseekV4Config) is flat; its __post_init__ derives qk_rope_head_dim from
    partial_rotary_factor when that is given."""
    if config.get("model_type") == "deepseek_v4":
        c = dict(config)
        if c.get("partial_rotary_factor"):
            c["qk_rope_head_dim"] = int(c["head_dim"] * c["partial_rotary_factor"])
        return c
    flat = dict(config.get("text_config") or {})
    flat.update({k: v for k, v in config.items() if k not in ("text_config", "vision_config")})
    return flat


def is_v4(c: dict) -> bool:
    """A DeepSeek-V4 drafter (vllm/models/deepseek_v4/) rather than V4.1's."""
    return c.get("model_type") == "deepseek_v4"


def n_layers(c: dict) -> int:
    """DSparkDeepseekV4Model.__init__: n_mtp_layers or num_nextn_predict_layers or 3 (V4:
    n_mtp_layers or 3)."""
    if is_v4(c):
        return c.get("n_mtp_layers") or 3
    return c.get("n_mtp_layers") or c.get("num_nextn_predict_layers") or 3


def noise_token_id(c: dict) -> int:
    """spec_decode/utils.py get_parallel_drafting_token_id, in its order."""
    nested = (c.get("dflash_config") or {}).get("mask_token_id")
    if nested is not None:
        return int(nested)
    for key in ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if c.get(key) is not None:
            return int(c[key])
    raise KeyError("no noise token id in the config")


def rope_parameters(c: dict) -> dict:
    """common/rope.py build_deepseek_v4_rope: the "main" dict of nested ones (the drafter's
    layers are sliding-window, compress_ratio 0), else the flat one."""
    rp = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        rp = rp["main"]
    return dict(rp)


# -- weights ---------------------------------------------------------------------------------

def w(weights: dict, name: str) -> torch.Tensor:
    return weights[name].to(F64)


def stage_weight(weights: dict, rest: str) -> torch.Tensor:
    """A model-level tensor (main_proj, main_norm, norm, markov_head, confidence_head):
    dspark.py _remap_dspark_name maps mtp.{any stage}.<rest> to model.<rest>."""
    found = [n for n in weights if re.fullmatch(rf"mtp\.\d+\.{re.escape(rest)}", n)]
    if len(found) != 1:
        raise KeyError(f"want one mtp.*.{rest}, found {found}")
    return w(weights, found[0])


def layer_weights(weights: dict, j: int) -> dict:
    """mtp.{j}.<rest> -> <rest> (vLLM: model.layers.{j}.<rest>)."""
    prefix = f"mtp.{j}."
    return {n[len(prefix):]: t.to(F64) for n, t in weights.items() if n.startswith(prefix)}


# -- small ops -------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """ir/ops/layernorm.py rms_norm (RMSNorm.forward_native; q_norm/kv_norm via
    FusedQKVRMSNormKernel.kernel, the same formula)."""
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


# -- RoPE ------------------------------------------------------------------------------------

def cos_sin_cache(c: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sliding-window layers' rotary table at `positions`, as vLLM builds it in float32:
    build_deepseek_v4_rope (rope_type deepseek_yarn, factor 1, mscale 0, theta rope_theta,
    rotary dim qk_rope_head_dim) -> get_rope -> DeepseekScalingRotaryEmbedding._compute_inv_freq
    and DeepseekV4ScalingRotaryEmbedding._compute_cos_sin_cache; factor 1 leaves plain RoPE
    up to the yarn blend's rounding, transcribed too."""
    rp = rope_parameters(c)
    dim, base = c["qk_rope_head_dim"], float(c["rope_theta"])
    max_pos = c["max_position_embeddings"]  # original_max_position_embeddings := it
    beta_fast, beta_slow = rp.get("beta_fast", 32), rp.get("beta_slow", 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (1.0 * pos_freqs)

    def correction_dim(rotations):  # common.py yarn_find_correction_dim
        return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)  # yarn_find_correction_range
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:  # yarn_linear_ramp_mask
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mask = 1 - ramp
    inv_freq = interpolation * (1 - mask) + extrapolation * mask
    t = positions.to(torch.float32)  # the table's rows are arange(max_pos) in float32
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return freqs.cos().to(F64), freqs.sin().to(F64)  # mscale = 1


def rope(x: torch.Tensor, c: dict, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """DeepseekV4ScalingRotaryEmbedding.forward_native: GPT-J (interleaved) rotation of the
    last qk_rope_head_dim dims of x [T, ..., D] at each token's position; inverse negates sin
    (FusedInvRopeFP8QuantKernel.kernel does the same for the attention output)."""
    dim = c["qk_rope_head_dim"]
    cos, sin = cos_sin_cache(c, positions)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim,)
    cos = cos.repeat_interleave(2, dim=-1).view(shape)
    sin = sin.repeat_interleave(2, dim=-1).view(shape)
    if inverse:
        sin = -sin
    x_pass, x_rot = x[..., :-dim], x[..., -dim:]
    rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)  # rotate_gptj
    return torch.cat((x_pass, x_rot * cos + rotated * sin), dim=-1)


# -- taps and context rows -------------------------------------------------------------------

def taps_projection(c: dict, weights: dict, taps: torch.Tensor) -> torch.Tensor:
    """DSparkDeepseekV4Model.combine_hidden_states: main_x = main_norm(main_proj(taps)), taps
    [T, hidden * len(dspark_target_layer_ids)] concatenated in layer order, each the mean of
    the hc copies of the stream entering that target layer (DeepseekV4DecoderLayer.forward's
    previous_post.mean(dim=1), the collapse kernel's write_aux); V4: of the stream leaving it
    (DeepseekV4Model.forward: mhc_post_tilelang(...).mean(dim=1) after layer idx, aux id
    idx + 1)."""
    projected = linear(taps.to(F64), stage_weight(weights, "main_proj.weight"))
    return rms_norm(projected, stage_weight(weights, "main_norm.weight"), c["rms_norm_eps"])


def kv_rows(c: dict, lw: dict, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One layer's key/value rows: wkv (the fused wq_a|wkv projection's kv part), kv_norm,
    RoPE at the absolute positions. DSparkDeepseekV4Model.precompute_and_store_context_kv and
    _insert_context_kv for the context; DeepseekV4Attention._split_qkv_and_norm and
    _fused_qnorm_rope_kv_insert for the block's own rows."""
    kv = rms_norm(linear(x, lw["attn.wkv.weight"]), lw["attn.kv_norm.weight"], c["rms_norm_eps"])
    return rope(kv, c, positions)


# -- attention -------------------------------------------------------------------------------

def window_start(c: dict, p0: int) -> int:
    """ComputeDSparkNoncausalSWAIndicesKernel.kernel: every block token sees positions
    [max(prefix_len - window, 0), seq_len), prefix_len = p0, seq_len = p0 + W."""
    return max(p0 - c["sliding_window"], 0)


def attention(c: dict, lw: dict, x: torch.Tensor, positions: torch.Tensor,
              context_rows: torch.Tensor) -> torch.Tensor:
    """DeepseekV4Attention.forward for the block x [W, hidden] at `positions`, attending
    non-causally to [context_rows (the window, already roped); the block's own rows]:
    q = wq_b(q_norm(wq_a x)) per head (no per-head norm in V4.1; V4: each head RMS-normed
    without a weight, _fused_qnorm_rope_kv_insert), RoPE; one softmax over the
    keys and the head's sink (FlashMLA's attn_sink; the sink term as
    _sparse_attn_prefill_ragged_kernel writes it), scale head_dim^-0.5; values are the key
    rows; then dsv41_o_proj / deep_gemm_fp8_o_proj: inverse RoPE of the output's rope dims,
    wo_a per group of heads (bmm over groups), wo_b."""
    heads, dim = c["num_attention_heads"], c["head_dim"]
    qr = rms_norm(linear(x, lw["attn.wq_a.weight"]), lw["attn.q_norm.weight"], c["rms_norm_eps"])
    q = linear(qr, lw["attn.wq_b.weight"]).view(-1, heads, dim)
    if is_v4(c):
        q = rms_norm(q, None, c["rms_norm_eps"])
    q = rope(q, c, positions)
    keys = torch.cat((context_rows, kv_rows(c, lw, x, positions)), dim=0)
    scores = torch.einsum("thd,kd->thk", q, keys) * dim ** -0.5
    sink = lw["attn.attn_sink"].view(1, heads, 1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(scores - top)
    o = torch.einsum("thk,kd->thd", p, keys) / (p.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
    o = rope(o, c, positions, inverse=True)
    groups, rank = c["o_groups"], c["o_lora_rank"]
    grouped = o.reshape(o.shape[0], groups, heads // groups * dim)
    wo_a = lw["attn.wo_a.weight"].view(groups, rank, -1)
    z = torch.einsum("tgi,gri->tgr", grouped, wo_a)
    return linear(z.flatten(1), lw["attn.wo_b.weight"])


# -- MoE -------------------------------------------------------------------------------------

def route(c: dict, lw: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's router (DeepseekV4MoE.__init__: dspark_n_routed_experts /
    dspark_num_experts_per_tok override the target's in V4.1, V4 takes the target's; gate.bias
    is loaded as
    e_score_correction_bias by load_weights): fp32 gate logits -> _dsv4_topk_kernel:
    w = sqrt(softplus(logit)) (softplus linear above 20), the top k of w + bias (the lowest id
    on a tie) chosen, w of the chosen renormalised to sum 1 (norm_topk_prob) and scaled by
    routed_scaling_factor (fused_topk_bias; MoERunner._maybe_apply_routed_scale_to_output is
    the same product). Returns (ids [T, k], weights [T, k])."""
    if c.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise NotImplementedError("V4.1 and V4 route with sqrtsoftplus")
    k = (not is_v4(c) and c.get("dspark_num_experts_per_tok")) or c["num_experts_per_tok"]
    logits = linear(x, lw["ffn.gate.weight"])
    scores = torch.sqrt(torch.where(logits > 20.0, logits, torch.log1p(torch.exp(logits))))
    bias = lw.get("ffn.gate.bias")
    current = scores + bias if bias is not None else scores.clone()
    ids = torch.empty(x.shape[0], k, dtype=torch.long)
    for slot in range(k):
        ids[:, slot] = current.argmax(dim=-1)  # torch's argmax: the first maximum
        current.scatter_(1, ids[:, slot:slot + 1], -math.inf)
    chosen = scores.gather(1, ids)
    if c["norm_topk_prob"]:
        total = chosen.sum(dim=-1, keepdim=True)
        chosen = chosen / torch.where(total > 0, total, torch.ones_like(total))
    return ids, chosen * c.get("routed_scaling_factor", 1.0)


def swiglu_mlp(c: dict, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
               x: torch.Tensor) -> torch.Tensor:
    """DeepseekV4MLP.forward (gate_up = [w1; w3]) with SiluAndMulWithClamp.forward_native /
    _swiglu_limit_torch: gate clamped above at swiglu_limit, up to +-swiglu_limit."""
    gate, up = linear(x, w1), linear(x, w3)
    limit = c["swiglu_limit"]
    if limit is not None and limit > 0:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    return linear(torch.nn.functional.silu(gate) * up, w2)


def moe(c: dict, lw: dict, x: torch.Tensor) -> torch.Tensor:
    """DeepseekV4MoE.forward: the routed experts' weighted sum plus the shared expert (none
    when n_shared_experts is null)."""
    ids, weights = route(c, lw, x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, weight in zip(ids[t].tolist(), weights[t]):
            p = f"ffn.experts.{e}."
            out[t] += weight * swiglu_mlp(c, lw[p + "w1.weight"], lw[p + "w3.weight"],
                                          lw[p + "w2.weight"], x[t:t + 1])[0]
    if c["n_shared_experts"]:  # vLLM: none when null; zero-wide (adds nothing) when 0
        p = "ffn.shared_experts."
        out = out + swiglu_mlp(c, lw[p + "w1.weight"], lw[p + "w3.weight"], lw[p + "w2.weight"], x)
    return out


# -- hyper-connections (mHC) -----------------------------------------------------------------

@dataclass
class HcPre:
    post: torch.Tensor      # [T, hc]: how much of the sublayer's output each copy takes
    comb: torch.Tensor      # [T, hc, hc]: comb[i, o], copy i's share in new copy o
    layer_input: torch.Tensor  # [T, hidden]: the collapsed, normed sublayer input
    pre: torch.Tensor       # [T, hc]: the pre-mix handed to the next sublayer


def hc_pre(c: dict, residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
           base: torch.Tensor, pre_mix: torch.Tensor | None, norm_weight: torch.Tensor,
           delayed: bool = True) -> HcPre:
    """mhc_pre_delayed_torch / mhc_pre_delayed_tilelang with norm_weight
    (hc_prenorm_gemm_tilelang then mhc_pre_big_fuse_with_norm_tilelang): mixes from the whole
    stream [T, hc*hidden] RMS-scaled (rms_norm_eps, no weight); pre = sigmoid + hc_eps;
    post = sigmoid * 2; comb = softmax rows + hc_eps, then columns, rows, ... normalised
    (Sinkhorn, hc_sinkhorn_iters in all, hc_eps in each denominator); the input collapsed with
    the carried pre_mix (stream 0 when None) and RMS-normed with the sublayer's norm.
    delayed=False (V4: mhc_pre_torch, mhc_pre_tilelang / mhc_fused_post_pre_tilelang with
    norm_weight): collapsed with the pre it computes, pre_mix unused."""
    hc, eps = c["hc_mult"], c["hc_eps"]
    x = residual.flatten(1)
    mixes = linear(x, fn) * torch.rsqrt(x.square().mean(-1, keepdim=True) + c["rms_norm_eps"])
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]) * HC_POST_MULT
    comb = mixes[:, 2 * hc:].view(-1, hc, hc) * scale[2] + base[2 * hc:].view(1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(c["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    if not delayed:
        collapsed = hc_collapse(residual, pre)
    else:
        collapsed = residual[:, 0] if pre_mix is None else hc_collapse(residual, pre_mix)
    return HcPre(post, comb, rms_norm(collapsed, norm_weight, c["rms_norm_eps"]), pre)


def hc_post(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """mhc_post_torch / the mhc_post_tilelang kernel: new copy o = sum_i comb[i, o] copy i
    + post[o] * x."""
    return torch.einsum("tio,tih->toh", comb, residual) + post.unsqueeze(-1) * x.unsqueeze(1)


def hc_collapse(streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
    """hc_collapse_triton (_hc_head_reduce_store_kernel): sum_m pre_mix[m] * copy m."""
    return (pre_mix.unsqueeze(-1) * streams).sum(dim=1)


def hc_head_pre(c: dict, weights: dict, streams: torch.Tensor) -> torch.Tensor:
    """V4's learned collapse weights, hc_head_fuse_tilelang pass 1: mixes = hc_head_fn . x
    with x the whole stream [T, hc*hidden], times rsqrt(sqrsum / (hc*hidden) + rms_norm_eps);
    pre = sigmoid(mixes * hc_head_scale[0] + hc_head_base) + hc_eps (pass 2 is hc_collapse).
    The tensors are mtp.{last}.hc_head_* (_remap_dspark_name's head prefixes)."""
    x = streams.flatten(1)
    mixes = linear(x, stage_weight(weights, "hc_head_fn"))
    mixes = mixes * torch.rsqrt(x.square().sum(-1, keepdim=True) / x.shape[-1] + c["rms_norm_eps"])
    return torch.sigmoid(mixes * stage_weight(weights, "hc_head_scale")[0]
                         + stage_weight(weights, "hc_head_base")) + c["hc_eps"]


# -- a decoder layer -------------------------------------------------------------------------

@dataclass
class LayerState:
    """What DeepseekV4DecoderLayer.forward carries from one layer to the next."""
    x: torch.Tensor          # the last sublayer's output (the embedding copies before layer 0)
    residual: torch.Tensor | None
    post: torch.Tensor | None
    comb: torch.Tensor | None
    pre_mix: torch.Tensor | None


def decoder_layer(c: dict, lw: dict, state: LayerState, positions: torch.Tensor,
                  context_rows: torch.Tensor, trace: dict | None = None) -> LayerState:
    """DeepseekV4DecoderLayer.forward on the DSpark path (no Engram, no sequence parallel):
    layer 0 takes the embedding copies as its residual and collapses stream 0; later layers
    first apply the previous FFN's post (mhc_shifted_post_pre); attention's input is collapsed
    with the carried pre-mix, the FFN's with attention's. V4 (its DeepseekV4DecoderLayer.forward:
    mhc_pre_tilelang, then mhc_fused_post_pre_tilelang): each with its own."""
    delayed = not is_v4(c)
    if state.residual is None:
        residual = state.x
    else:
        residual = hc_post(state.x, state.residual, state.post, state.comb)
    attn_hc = hc_pre(c, residual, lw["hc_attn_fn"], lw["hc_attn_scale"], lw["hc_attn_base"],
                     state.pre_mix, lw["attn_norm.weight"], delayed)
    attn_out = attention(c, lw, attn_hc.layer_input, positions, context_rows)
    attn_residual, residual = residual, hc_post(attn_out, residual, attn_hc.post, attn_hc.comb)
    ffn_hc = hc_pre(c, residual, lw["hc_ffn_fn"], lw["hc_ffn_scale"], lw["hc_ffn_base"],
                    attn_hc.pre, lw["ffn_norm.weight"], delayed)
    ffn_out = moe(c, lw, ffn_hc.layer_input)
    if trace is not None:
        trace.update(attn_residual=attn_residual, attn_hc=attn_hc, attn_out=attn_out,
                     ffn_residual=residual, ffn_hc=ffn_hc, route=route(c, lw, ffn_hc.layer_input),
                     ffn_out=ffn_out)
    return LayerState(ffn_out, residual, ffn_hc.post, ffn_hc.comb, ffn_hc.pre)


# -- heads -----------------------------------------------------------------------------------

def head_logits(c: dict, weights: dict, head_hidden: torch.Tensor) -> torch.Tensor:
    """DSparkDeepseekV4ForCausalLM.compute_logits: the target's head over norm(head_hidden)."""
    normed = rms_norm(head_hidden, stage_weight(weights, "norm.weight"), c["rms_norm_eps"])
    return linear(normed, w(weights, "head.weight"))


def markov_factor(weights: dict, factor: str) -> torch.Tensor:
    """markov_w1 / markov_w2: V4.1's checkpoint calls them markov_head.embed / head (its
    _remap_dspark_name maps them), V4's keeps markov_head.markov_w1 / markov_w2."""
    v41 = {"markov_w1": "embed", "markov_w2": "head"}[factor]
    if any(re.fullmatch(rf"mtp\.\d+\.markov_head\.{factor}\.weight", n) for n in weights):
        return stage_weight(weights, f"markov_head.{factor}.weight")
    return stage_weight(weights, f"markov_head.{v41}.weight")


def markov_embed(weights: dict, tokens: torch.Tensor) -> torch.Tensor:
    """DSparkMarkovHead.embed: markov_w1 rows."""
    return markov_factor(weights, "markov_w1")[tokens]


def markov_bias(weights: dict, embed: torch.Tensor) -> torch.Tensor:
    """DSparkMarkovHead.bias: markov_w2 (stored [vocab, rank]) as a head."""
    return linear(embed, markov_factor(weights, "markov_w2"))


def confidence(weights: dict, head_hidden: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """DSparkConfidenceHead.forward + compute_confidence: sigmoid(proj([pre-norm hidden;
    Markov embedding of the previous token])), proj without bias (DSparkDeepseekV4Model
    builds the head with the default bias=False)."""
    logit = linear(torch.cat((head_hidden, embed), dim=-1),
                   stage_weight(weights, "confidence_head.proj.weight"))
    return torch.sigmoid(logit[:, 0])


# -- one draft block -------------------------------------------------------------------------

@dataclass
class DraftBlock:
    main_x: torch.Tensor       # [C, hidden]: projected taps of the context rows given
    head_hidden: torch.Tensor  # [W, hidden]: the collapsed pre-norm output
    base_logits: torch.Tensor  # [W, vocab]: head(norm(head_hidden))
    logits: torch.Tensor       # [W, vocab]: base + the Markov bias of the previous draft
    drafts: torch.Tensor       # [W]: greedy, left to right
    confidences: torch.Tensor | None  # [W], None without a confidence head
    block_tokens: torch.Tensor  # [W]: [seed, noise x (W-1)]
    block_positions: torch.Tensor  # [W]: p0 .. p0 + W - 1


def draft_block(config: dict, weights: dict, taps: torch.Tensor, positions: torch.Tensor,
                seed_token: int, block_size: int | None = None,
                trace: dict | None = None) -> DraftBlock:
    """One DSpark pass and its greedy Markov chain, as vLLM's DSpark speculator runs it:
    taps [C, hidden * k] of the committed positions `positions` (consecutive, ending at
    p0 - 1, covering the window); the seed (the last sampled token) at p0.

    _prepare_dflash_inputs_kernel (sample_from_anchor): block = [seed, noise x (W-1)] at
    p0 .. p0+W-1, noise = get_parallel_drafting_token_id; W = num_speculative_tokens
    (block_size, else dspark_block_size). DSparkDeepseekV4Model.forward: embedding copied to
    hc_mult streams, the layers, mhc_post of the last FFN, hc_collapse with its pre-mix (V4:
    with hc_head's, hc_head_fused_kernel_tilelang).
    DSparkSpeculator._sample_sequential: logits_i = base_i + markov_bias(markov_embed(x_{i-1})),
    x_0 = seed, draft_i = argmax; confidences from the same embeddings.

    `trace`, when given, receives every stage's inputs and outputs (trace["layers"][j]: the
    carried state, context rows, each mixer's residual and HcPre, attention and MoE outputs,
    the routing; then the last streams and pre-mix): what a stage-by-stage comparison feeds."""
    c = text_config(config)
    for j in range(0 if is_v4(c) else n_layers(c)):  # V4's drafter layers: ratio 1, always
        ratios = c.get("compress_ratios")
        if ratios is not None and c["num_hidden_layers"] + j < len(ratios) \
                and ratios[c["num_hidden_layers"] + j]:
            raise NotImplementedError("a compressed drafter layer (compress_ratio > 0)")
    width = block_size or c.get("block_size") or c["dspark_block_size"]
    positions = torch.as_tensor(positions, dtype=torch.long)
    p0 = int(positions[-1]) + 1
    start = window_start(c, p0)
    if not torch.equal(positions, torch.arange(p0 - len(positions), p0)) or positions[0] > start:
        raise ValueError("the taps must be of consecutive positions covering the window")
    in_window = positions >= start
    main_x = taps_projection(c, weights, taps)
    tokens = torch.tensor([seed_token] + [noise_token_id(c)] * (width - 1))
    block_positions = torch.arange(p0, p0 + width)
    embeddings = w(weights, "embed.weight")[tokens]
    state = LayerState(embeddings.unsqueeze(1).repeat(1, c["hc_mult"], 1), None, None, None, None)
    for j in range(n_layers(c)):
        lw = layer_weights(weights, j)
        context_rows = kv_rows(c, lw, main_x[in_window], positions[in_window])
        layer_trace = None
        if trace is not None:
            layer_trace = trace.setdefault("layers", {}).setdefault(j, {})
            layer_trace.update(state_in=state, context_rows=context_rows)
        state = decoder_layer(c, lw, state, block_positions, context_rows, layer_trace)
    streams = hc_post(state.x, state.residual, state.post, state.comb)
    head_pre = hc_head_pre(c, weights, streams) if is_v4(c) else state.pre_mix
    head_hidden = hc_collapse(streams, head_pre)
    base = head_logits(c, weights, head_hidden)
    previous, logits, drafts, embeds = torch.tensor([seed_token]), [], [], []
    for i in range(width):
        embed = markov_embed(weights, previous)
        logits.append(base[i] + markov_bias(weights, embed)[0])
        previous = logits[-1].argmax().view(1)
        drafts.append(int(previous))
        embeds.append(embed[0])
    has_confidence = c.get("enable_confidence_head", True) and any(
        re.fullmatch(r"mtp\.\d+\.confidence_head\.proj\.weight", n) for n in weights)
    confidences = confidence(weights, head_hidden, torch.stack(embeds)) if has_confidence else None
    if trace is not None:
        trace.update(streams=streams, pre=head_pre)
    return DraftBlock(main_x, head_hidden, base, torch.stack(logits), torch.tensor(drafts),
                      confidences, tokens, block_positions)
