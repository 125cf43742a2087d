"""The drafter round on the native kernels: weights packed once from a DSparkModel, every
buffer of a round preallocated in a Workspace (static shapes: a round is one CUDA graph,
and the gate can poison every output before a run and see that each was written).

Launches per round: context projection; per layer the context k|v projection (context
RMSNorm fused into its operand load), the block q|k|v projection (input RMSNorm fused),
attention, o_proj + residual, gate/up + SwiGLU (post-attention RMSNorm fused), down +
residual; the head (final RMSNorm fused, float32 logits for all W positions in one pass
over the head's weights); then per draft position the Markov correction with a per-tile
argmax and the argmax across tiles. The block's embedding gather and the RoPE tables are
torch ops on the device (the tables come from remote_drafter.models.llama_layers.rotate itself).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch

from remote_drafter.models.cuda_graphs import no_collection
from remote_drafter.models.dspark import DSparkModel
from remote_drafter.models.llama_layers import rotate

from . import kernels as K
from .staged_round import RoundInputs


def with_width(model: DSparkModel, width: int) -> DSparkModel:
    """The same weights drafting `width` tokens per pass (block_size is no weight's shape)."""
    m = copy.copy(model)
    m.config = replace(model.config, block_size=width)
    return m


@dataclass
class Workspace:
    """Every input and output buffer of a round for B requests at block width W."""
    batch: int
    width: int
    bufs: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getattr__(self, name):
        try:
            return self.__dict__["bufs"][name]
        except KeyError:
            raise AttributeError(name) from None

    def load(self, inputs: RoundInputs) -> None:
        """Copy a round's inputs into the static input buffers (outside any graph)."""
        for name in ("ctx", "ctx_valid", "ctx_pos", "anchor", "anchor_pos"):
            self.bufs["in_" + name].copy_(getattr(inputs, name))

    def poison(self) -> None:
        """NaN in every float output, -1 in the tokens: what a run leaves unwritten shows."""
        for name, t in self.bufs.items():
            if not name.startswith("in_"):
                t.fill_(float("nan") if t.is_floating_point() else -1)


class NativeRound:
    """DSparkModel's round (block_logits, then the greedy Markov chain) on the kernels."""

    def __init__(self, model: DSparkModel, tiles: K.Tiles | None = None):
        """`tiles`: those the card's shared memory fits unless given (kernels.tiles_for)."""
        dtypes = {p.dtype for p in model.parameters()} | {model.embed.dtype, model.head.dtype}
        if dtypes != {torch.float32}:
            raise ValueError(f"the native kernels compute float32 drafters (the worker's default "
                             f"--dtype); this one holds {sorted(map(str, dtypes))}")
        c = self.config = model.config
        self.device = model.embed.device
        self.tiles = tiles or K.tiles_for(self.device)
        self.eps, self.theta = c.rms_norm_eps, c.rope_theta
        self.heads, self.kv_heads = c.num_heads, c.num_kv_heads
        self.head_dim = c.hidden_size // c.num_heads
        w = lambda t: t.detach().contiguous()  # noqa: E731
        self.embed, self.head = w(model.embed), w(model.head)
        self.wc, self.ctx_norm, self.norm = w(model.ctx_proj.weight), w(model.ctx_norm.weight), w(model.norm.weight)
        self.layers = []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append({
                "wkv": w(torch.cat([a.k_proj.weight, a.v_proj.weight])),
                "wqkv": w(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                "wo": w(a.o_proj.weight), "wg": w(mlp.gate_proj.weight), "wu": w(mlp.up_proj.weight),
                "wd": w(mlp.down_proj.weight), "in_norm": w(layer.input_layernorm.weight),
                "post_norm": w(layer.post_attention_layernorm.weight)})
        self.w1, self.w2 = w(model.markov.w1.weight), w(model.markov.w2.weight)
        self.unit = torch.cat([torch.ones(self.head_dim // 2), torch.zeros(self.head_dim // 2)]).to(self.device)

    def workspace(self, batch: int, width: int | None = None, probs: bool = False) -> Workspace:
        """Buffers for `batch` requests; `probs`: also keep each layer's attention
        probabilities (the gate's stage zero; not needed to serve)."""
        c, dev = self.config, self.device
        wd = width or c.block_size
        n, r, v = c.window, batch * (width or c.block_size), c.vocab_size
        f32 = dict(device=dev, dtype=torch.float32)
        qd, kvd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        b = {"in_ctx": (torch.zeros(batch, n, c.feature, **f32) if c.feature   # hidden rows
                        else torch.zeros(batch, n, device=dev, dtype=torch.long)),  # token ids
             "in_ctx_valid": torch.zeros(batch, n, device=dev, dtype=torch.bool),
             "in_ctx_pos": torch.zeros(batch, n, device=dev, dtype=torch.long),
             "in_anchor": torch.zeros(batch, device=dev, dtype=torch.long),
             "in_anchor_pos": torch.zeros(batch, device=dev, dtype=torch.long),
             "x0": torch.empty(r, c.hidden_size, **f32),
             "ctx": torch.empty(batch * n, c.hidden_size, **f32),
             "cos_c": torch.empty(batch * n, self.head_dim // 2, **f32),
             "sin_c": torch.empty(batch * n, self.head_dim // 2, **f32),
             "cos_b": torch.empty(r, self.head_dim // 2, **f32),
             "sin_b": torch.empty(r, self.head_dim // 2, **f32),
             "z": torch.empty(r, v, **f32), "logits": torch.empty(batch, wd, v, **f32),
             "best_v": torch.empty(batch, triton_tiles(v), **f32),
             "best_i": torch.empty(batch, triton_tiles(v), device=dev, dtype=torch.int32),
             "tokens": torch.empty(batch, wd, device=dev, dtype=torch.long)}
        for i in range(c.num_layers):
            b |= {f"L{i}.ctx_kv": torch.empty(batch * n, 2 * kvd, **f32),
                  f"L{i}.qkv": torch.empty(r, qd + 2 * kvd, **f32),
                  f"L{i}.attn": torch.empty(r, qd, **f32),
                  f"L{i}.attn_resid": torch.empty(r, c.hidden_size, **f32),
                  f"L{i}.mlp_act": torch.empty(r, c.ffn, **f32),
                  f"L{i}.out": torch.empty(r, c.hidden_size, **f32)}
            if probs:
                b[f"L{i}.attn_probs"] = torch.empty(batch, self.heads, wd, n + wd, **f32)
        return Workspace(batch, wd, b)

    # -- the round ---------------------------------------------------------------------------
    def block_logits(self, ws: Workspace) -> torch.Tensor:
        """z [B*W, V] float32 from the workspace's inputs (DSparkModel.block_logits)."""
        c, b, wd = self.config, ws.batch, ws.width
        n = c.window
        ctx_in = ws.in_ctx if c.feature else self.embed[ws.in_ctx]
        t = self.tiles
        K.linear(ctx_in.reshape(b * n, -1), self.wc, ws.ctx, tiles=t)
        block_pos = ws.in_anchor_pos[:, None] + torch.arange(wd, device=self.device)
        for pos, cos, sin in ((ws.in_ctx_pos, ws.cos_c, ws.sin_c), (block_pos, ws.cos_b, ws.sin_b)):
            table = rotate(self.unit.expand(pos.shape[0], 1, pos.shape[1], self.head_dim), pos, self.theta)
            cos.copy_(table[:, 0, :, : self.head_dim // 2].reshape(cos.shape))
            sin.copy_(table[:, 0, :, self.head_dim // 2:].reshape(sin.shape))
        ids = torch.full((b, wd), c.mask_token_id, device=self.device, dtype=torch.long)
        ids[:, 0] = ws.in_anchor
        ws.x0.copy_(self.embed[ids.view(-1)])
        x = ws.x0
        for i, L in enumerate(self.layers):
            kv, qkv, attn = ws.bufs[f"L{i}.ctx_kv"], ws.bufs[f"L{i}.qkv"], ws.bufs[f"L{i}.attn"]
            K.linear(ws.ctx, L["wkv"], kv, norm=self.ctx_norm, eps=self.eps, tiles=t)
            K.linear(x, L["wqkv"], qkv, norm=L["in_norm"], eps=self.eps, tiles=t)
            K.attention(qkv, kv, ws.cos_c, ws.sin_c, ws.cos_b, ws.sin_b, ws.in_ctx_valid, attn,
                        ws.bufs.get(f"L{i}.attn_probs"), batch=b, heads=self.heads,
                        kv_heads=self.kv_heads, head_dim=self.head_dim, block=wd, window=n, tiles=t)
            resid = ws.bufs[f"L{i}.attn_resid"]
            K.linear(attn, L["wo"], resid, resid=x, tiles=t)
            act = ws.bufs[f"L{i}.mlp_act"]
            K.linear(resid, L["wg"], act, norm=L["post_norm"], eps=self.eps, w2=L["wu"], tiles=t)
            x = ws.bufs[f"L{i}.out"]
            K.linear(act, L["wd"], x, resid=resid, tiles=t)
        return K.linear(x, self.head, ws.z, norm=self.norm, eps=self.eps, tiles=t)

    def correct(self, ws: Workspace, i: int, previous: torch.Tensor, tokens: torch.Tensor | None = None):
        """Position i's corrected logits [B, V] (z_i + W2 W1[previous]); with `tokens` [B]
        (a view), also their argmax into it."""
        z = ws.z.view(ws.batch, ws.width, -1)[:, i]
        return K.markov(z, previous, self.w1, self.w2, ws.logits[:, i], ws.best_v, ws.best_i, tokens)

    def run(self, ws: Workspace) -> torch.Tensor:
        """One greedy round: tokens [B, W] (device), nothing read back to the host."""
        self.block_logits(ws)
        previous = ws.in_anchor
        for i in range(ws.width):
            self.correct(ws, i, previous, ws.tokens[:, i])
            previous = ws.tokens[:, i]
        return ws.tokens

    def stages(self, ws: Workspace) -> dict[str, torch.Tensor]:
        """The workspace's outputs shaped as reference.staged_round's stages."""
        b, wd, n = ws.batch, ws.width, self.config.window
        out = {"ctx": ws.ctx.view(b, n, -1)}
        for i in range(self.config.num_layers):
            out[f"L{i}.ctx_kv"] = ws.bufs[f"L{i}.ctx_kv"].view(b, n, -1)
            out[f"L{i}.qkv"] = ws.bufs[f"L{i}.qkv"].view(b, wd, -1)
            if f"L{i}.attn_probs" in ws.bufs:
                out[f"L{i}.attn_probs"] = ws.bufs[f"L{i}.attn_probs"]
            for s in ("attn", "attn_resid", "mlp_act", "out"):
                out[f"L{i}.{s}"] = ws.bufs[f"L{i}.{s}"].view(b, wd, -1)
        out["head.logits"] = ws.z.view(b, wd, -1)
        out["markov.logits"] = ws.logits
        out["draft.tokens"] = ws.tokens
        return out

    def capture(self, ws: Workspace, warmup: int = 2) -> torch.cuda.CUDAGraph:
        """A CUDA graph of run(ws): replay() after ws.load() drafts a round with no launch
        overhead (kernels compile in the warm-up, on a side stream as capture requires)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.run(ws)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(graph):  # no graph collected mid-capture
            self.run(ws)
        return graph


def triton_tiles(vocab: int) -> int:
    return -(-vocab // K.MARKOV_BV)
