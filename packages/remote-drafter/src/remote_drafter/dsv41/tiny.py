"""A tiny random DeepSeek-V4.1 checkpoint for tests: the drafter's tensors under DeepSeek's
names, dtypes and scales (FP8 linears in 128 x 128 blocks, FP4 or FP8 experts) at toy width
(hidden 256: main_proj, wq_b and the shared expert span several blocks, wq_a ends in a partial
one), plus a few of the target's tensors (`layers.0.*`, `norm.weight`) that a drafter loader
must skip; config.json nested under `text_config` as vLLM's DeepseekV41Config reads it, an
index and two shards, each holding trunk tensors.

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
from .config import Dsv41DrafterConfig, expected_tensors, weight_table

HIDDEN, VOCAB, TARGET_LAYERS = 256, 1024, 4
# Tensors of the target written beside the drafter's: the trunk's layer 0 (copies of mtp.0's
# shapes and kinds) and its final norm.
TRUNK_FROM_FIRST_LAYER = ("attn_norm.weight", "attn.wq_a.weight", "ffn.experts.0.w1.weight")


def tiny_config(n_mtp_layers: int = 3, expert_dtype: str = "fp4") -> dict:
    """config.json of a toy V4.1: the drafter's keys as vLLM 0.33 reads them."""
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "num_hidden_layers": TARGET_LAYERS, "n_mtp_layers": n_mtp_layers,
        "compress_ratios": [0, 4, 128, 4],  # the trunk's; drafter layers past it: 0
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
        "num_attention_heads": 4, "head_dim": 128, "qk_rope_head_dim": 32,
        "q_lora_rank": 192, "o_groups": 2, "o_lora_rank": 64,
        "sliding_window": 128, "rope_theta": 10000.0,
        "n_routed_experts": 8, "num_experts_per_tok": 2,
        "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "n_shared_experts": 1, "swiglu_limit": 10.0,
        "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "dspark_target_layer_ids": [1, 2, 3], "dspark_block_size": 5, "dspark_markov_rank": 32,
        "dspark_noise_token_id": VOCAB - 1, "enable_confidence_head": True,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "torch_dtype": "bfloat16", "text_config": text,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                                "expert_dtype": expert_dtype},
    }


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


def tiny_tensors(config: Dsv41DrafterConfig, seed: int = 0) -> tuple[dict, dict]:
    """(the drafter's tensors, some of the target's), as stored."""
    gen = torch.Generator().manual_seed(seed)
    kinds, table = expected_tensors(config), weight_table(config)
    drafter = {}
    for name, (shape, _) in table.items():
        drafter.update(stored(name, random_values(name, shape, config, gen), kinds, name, config))
    trunk = {}
    for rest in TRUNK_FROM_FIRST_LAYER:
        source = "mtp.0." + rest
        values = random_values(source, table[source][0], config, gen)
        trunk.update(stored("layers.0." + rest, values, kinds, source, config))
    trunk["norm.weight"] = (1 + 0.05 * torch.randn(config.hidden_size, generator=gen)).to(torch.bfloat16)
    return drafter, trunk


def write_tiny(out: str, seed: int = 0, expert_dtype: str = "fp4", n_mtp_layers: int = 3) -> dict:
    """Write the checkpoint to `out`; returns {"drafter": n, "trunk": n, "bytes": n, "files": [...]}."""
    config_json = tiny_config(n_mtp_layers, expert_dtype)
    drafter, trunk = tiny_tensors(Dsv41DrafterConfig.from_json(config_json), seed)
    # Shard 1: the embedding and the trunk's layer 0; shard 2: the rest (the trunk's norm too)
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
    return {"drafter": len(drafter), "trunk": len(trunk), "bytes": total, "files": files}
