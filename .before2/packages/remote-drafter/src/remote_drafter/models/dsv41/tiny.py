"""A tiny random DeepSeek-V4.1 or DeepSeek-V4 checkpoint for tests: the drafter's tensors
under DeepSeek's names, dtypes and scales (FP8 linears in 128 x 128 blocks, FP4 or FP8
experts, or plain bf16 without a quantization_config) at toy width (hidden 256: main_proj,
wq_b and the shared expert span several blocks, wq_a ends in a partial one), plus a few of the
target's tensors (`layers.0.*`, `norm.weight`) that a drafter loader must skip, or, for V4, the
whole trunk a V4 loader reads (full_trunk); an index and two shards, each holding trunk
tensors. config.json as vLLM reads it: V4.1's nested under `text_config`
(DeepseekV41Config), V4's flat (DeepseekV4Config, exllamav3's DeepseekV4Config: the drafter
layers counted by compress_ratios' tail past the trunk too).

Values are scaled so the forward stays near unit scale: linears N(0, 1/fan_in), RMSNorm
weights near 1, the embedding N(0, 1), the Markov factors so their bias is about N(0, 1).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from . import quant
from .checkpoint import CONFIG_FILE, INDEX_FILE, scale_of
from .config import Dsv41DrafterConfig, expected_tensors, layer_table, stored_tensors, weight_table

HIDDEN, VOCAB, TARGET_LAYERS = 256, 1024, 4
# Tensors of the target written beside the drafter's: the trunk's layer 0 (copies of mtp.0's
# shapes and kinds) and its final norm.
TRUNK_FROM_FIRST_LAYER = ("attn_norm.weight", "attn.wq_a.weight", "ffn.experts.0.w1.weight")
# The toy's text config, both variants; V4.1 alone adds its own keys (V41_ONLY)
TEXT = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": TARGET_LAYERS,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
    "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 32,
    "q_lora_rank": 192, "o_groups": 2, "o_lora_rank": 64,
    "sliding_window": 128, "rope_theta": 10000.0,
    "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "n_shared_experts": 1, "swiglu_limit": 10.0,
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "dspark_target_layer_ids": [1, 2, 3], "dspark_block_size": 5, "dspark_markov_rank": 32,
    "dspark_noise_token_id": VOCAB - 1, "enable_confidence_head": True,
}
V41_ONLY = {"model_type": "deepseek_v41_text", "n_routed_experts": 8,  # the target's
            "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
            "compress_ratios": [0, 4, 128, 4]}  # the trunk's; drafter layers past it: 0
# V4-Flash's keys a V4 loader reads beside the drafter's (sliding-window layers, no hash MoE)
V4_ONLY = {"num_key_value_heads": 1, "num_nextn_predict_layers": 1, "num_hash_layers": 0,
           "compress_rope_theta": 160000.0, "index_n_heads": 64, "index_head_dim": 128,
           "index_topk": 512, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False}
VARIANT_NAMES = ("v41", "v4")


def tiny_config(n_mtp_layers: int = 3, expert_dtype: str = "fp4", variant: str = "v41",
                quantized: bool = True, overrides: dict | None = None) -> dict:
    """config.json of a toy V4.1 or V4: the drafter's keys as vLLM 0.33 reads them, the text
    keys updated with `overrides` (hidden_size, vocab_size, num_hidden_layers, heads, ...)."""
    if variant not in VARIANT_NAMES:
        raise ValueError(f"variant {variant!r}: one of {VARIANT_NAMES}")
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                    "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                    "expert_dtype": expert_dtype}
    text = {**TEXT, "n_mtp_layers": n_mtp_layers, **(V41_ONLY if variant == "v41" else V4_ONLY)}
    text.update(overrides or {})
    if variant == "v41":
        config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
                  "torch_dtype": "bfloat16", "text_config": text}
    else:  # flat; expert_dtype on the top level, where V4's quant config reads it
        config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                  "torch_dtype": "bfloat16", "expert_dtype": expert_dtype,
                  "compress_ratios": [0] * (text["num_hidden_layers"] + n_mtp_layers), **text}
    if quantized:
        config["quantization_config"] = quantization
    return config


def random_values(name: str, shape: tuple[int, ...], config: Dsv41DrafterConfig,
                  gen: torch.Generator) -> torch.Tensor:
    """float32 values for `name`, scaled for a sane forward (see the module docstring), on
    the generator's device."""
    noise = torch.randn(shape, generator=gen, device=gen.device)
    if name.endswith("norm.weight"):
        return 1 + 0.05 * noise
    if name == "embed.weight":
        return noise
    if ".markov_head." in name:  # bias = head . embed[x] sums markov_rank products
        return noise * config.markov_rank ** -0.25
    if name.endswith("_scale"):  # hc_*_scale: the mixers' gains
        return 1 + 0.1 * noise
    if len(shape) == 1:          # attention sinks, router bias, hc_*_base
        return 0.1 * noise
    return noise / shape[-1] ** 0.5


def stored(name: str, values: torch.Tensor, kinds: dict, kind_of: str,
           config: Dsv41DrafterConfig) -> dict[str, torch.Tensor]:
    """`values` stored under `name` as DeepSeek stores `kind_of` (with its scale if quantised)."""
    kind = kinds[kind_of].kind
    if kind == "fp8":
        e8m0 = kinds[scale_of(kind_of)].kind == "e8m0"
        weight, scale = quant.quantize_fp8(values, config.weight_block_size, ue8m0=e8m0)
        return {name: weight, scale_of(name): scale}
    if kind == "fp4":
        weight, scale = quant.quantize_fp4(values)
        return {name: weight, scale_of(name): scale}
    return {name: values.to(torch.bfloat16 if kind == "bf16" else torch.float32)}


def trunk_table(config: Dsv41DrafterConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a V4 trunk of sliding-window, non-hash layers as the drafter's sizes
    describe it: the final norm, the learned hc_head collapse and each layer (the drafter's
    per-layer table under `layers.{i}.`). The embedding and head are the drafter's."""
    h, k = config.hidden_size, config.hc_mult
    table = {"norm.weight": ((h,), "bf16"), "hc_head_fn": ((k, k * h), "f32"),
             "hc_head_base": ((k,), "f32"), "hc_head_scale": ((1,), "f32")}
    for i in range(config.num_hidden_layers):
        table.update(layer_table(config, f"layers.{i}."))
    return table


def tiny_tensors(config: Dsv41DrafterConfig, seed: int = 0,
                 full_trunk: bool = False) -> tuple[dict, dict]:
    """(the drafter's tensors, the target's: a few, or the whole V4 trunk), as stored."""
    gen = torch.Generator().manual_seed(seed)
    kinds, table = expected_tensors(config), weight_table(config)
    drafter = {}
    for name, (shape, _) in table.items():
        drafter.update(stored(name, random_values(name, shape, config, gen), kinds, name, config))
    trunk = {}
    if full_trunk:
        trunk_kinds = stored_tensors(config, trunk_table(config))
        for name, (shape, _) in trunk_table(config).items():
            trunk.update(stored(name, random_values(name, shape, config, gen), trunk_kinds, name, config))
        return drafter, trunk
    for rest in TRUNK_FROM_FIRST_LAYER:
        source = "mtp.0." + rest
        values = random_values(source, table[source][0], config, gen)
        trunk.update(stored("layers.0." + rest, values, kinds, source, config))
    trunk["norm.weight"] = (1 + 0.05 * torch.randn(config.hidden_size, generator=gen)).to(torch.bfloat16)
    return drafter, trunk


def write_tiny(out: str, seed: int = 0, expert_dtype: str = "fp4", n_mtp_layers: int = 3,
               variant: str = "v41", config_overrides: dict | None = None,
               quantized: bool = True, full_trunk: bool = False) -> dict:
    """Write the checkpoint to `out`; returns {"drafter": n, "trunk": n, "bytes": n, "files": [...],
    "config": config.json's dict}. `config_overrides` updates the text config (sizes, layers,
    heads, taps...); quantized=False writes no quantization_config and every linear in bf16;
    full_trunk (V4 only) writes every trunk tensor a V4 loader reads."""
    config_json = tiny_config(n_mtp_layers, expert_dtype, variant, quantized, config_overrides)
    config = Dsv41DrafterConfig.from_json(config_json)
    if full_trunk and variant != "v4":
        raise ValueError("full_trunk writes a DeepSeek-V4 trunk: variant='v4'")
    drafter, trunk = tiny_tensors(config, seed, full_trunk)
    # Shard 1: the embedding and the trunk's layers; shard 2: the rest (the trunk's norm too)
    in_first = {"embed.weight", *(n for n in trunk if n.startswith("layers."))}
    every = {**drafter, **trunk}
    first = {n: t for n, t in every.items() if n in in_first}
    second = {n: t for n, t in every.items() if n not in in_first}
    os.makedirs(out, exist_ok=True)
    files = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    weight_map, total = {}, 0
    for file, tensors in zip(files, (first, second)):
        save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(out, file),
                  metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                  f, indent=1)
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(config_json, f, indent=1)
    return {"drafter": len(drafter), "trunk": len(trunk), "bytes": total, "files": files,
            "config": config_json}
