"""A Llama-architecture causal LM in plain torch: the target of the tests, the reference
loop and shadow runs, and the model the `lm` drafter runs. Loads and saves Hugging Face
Llama folders (config.json + model.safetensors), e.g. the SmolLM2-135M miniature.

forward() returns next-token logits and the hidden states of chosen layers (the residual
stream after layer l), which a hidden-state-conditioned drafter consumes."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .llama_layers import Block, RMSNorm


@dataclass
class LlamaConfig:
    vocab_size: int = 96
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf(cls, data: dict) -> LlamaConfig:
        """From a Hugging Face config.json; newer transformers keep rope_theta under
        rope_parameters (reading only the top level gave SmolLM2 the default 10,000 instead
        of its 100,000). Refuses what this model does not implement."""
        data = {**data, **(data.get("rope_parameters") or {})}
        if data.get("rope_type", "default") != "default" or data.get("rope_scaling"):
            raise ValueError(f"unsupported RoPE: {data.get('rope_type')} {data.get('rope_scaling')}")
        if data.get("head_dim", data["hidden_size"] // data["num_attention_heads"]) != \
                data["hidden_size"] // data["num_attention_heads"]:
            raise ValueError(f"head_dim {data['head_dim']} is not hidden_size / heads")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class Backbone(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                          c.intermediate_size, c.rms_norm_eps, c.rope_theta)
                                    for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, hidden_layers: tuple[int, ...] = ()):
        """tokens [T] -> (logits [T, V] float32, hidden [T, len(hidden_layers) * H])."""
        x = self.model.embed_tokens(tokens[None])
        t = tokens.shape[0]
        pos = torch.arange(t, device=tokens.device)[None]
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None]
        kept = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, pos, causal)
            if i in hidden_layers:
                kept.append(x[0])
        logits = (self.model.norm(x) @ self.head_weight.T)[0].float()
        hidden = torch.cat(kept, -1).float() if kept else logits.new_zeros(t, 0)
        return logits, hidden

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                       **asdict(self.config)}, f, indent=1)

    @classmethod
    def load(cls, folder: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaLM:
        with open(os.path.join(folder, "config.json")) as f:
            config = LlamaConfig.from_hf(json.load(f))
        model = cls(config)
        state = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(folder, name)))
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=True)
        return model.to(device=device, dtype=dtype).eval()


def random_llama(config: LlamaConfig, seed: int = 0, proj_std: float = 0.2,
                  embed_std: float = 1.0) -> LlamaLM:
    """A random target for tests. Projections large enough that it does not just repeat
    its input token (its greedy text varies); `embed_std` sets how peaked its next-token
    distributions are (small: flat, for sampling tests)."""
    torch.manual_seed(seed)
    model = LlamaLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, proj_std if "proj" in name else embed_std)
    return model.eval()
