"""The staged reference: hand-checked stages (numpy loops written from the formulas, not
from the module), the module's own output unchanged by the hooks, and final drafts equal
to the torch DSparkDrafter's."""

import numpy as np
import torch
from native_kernel_support import tiny_model

from native_drafter.kernel_gate import random_inputs
from native_drafter.staged_round import RoundInputs, as_dtype, stage_names, staged_round
from remote_drafter.engine.identity import Manifest
from remote_drafter.models.base import DraftRequest
from remote_drafter.models.dspark import DSparkDrafter


def f64(inputs: RoundInputs) -> RoundInputs:
    return RoundInputs(inputs.ctx.double(), inputs.ctx_valid, inputs.ctx_pos, inputs.anchor, inputs.anchor_pos)


def case(seed=0, batch=3, width=5):
    model = tiny_model(seed, width)
    inputs = random_inputs(model.config, batch, torch.Generator().manual_seed(seed + 100))
    return model, inputs, staged_round(as_dtype(model, torch.float64), f64(inputs))


def close(got, want, tol):
    """Normwise: remote_drafter's RMSNorm, RoPE and attention compute in float32 inside (by
    its design, so in the float64 reference too): stages after them carry ~1e-7."""
    got = got.numpy() if isinstance(got, torch.Tensor) else got
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol


def rms(x, g, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * g


def test_every_stage_is_there_with_its_shape():
    model, inputs, ref = case()
    c, b = model.config, 3
    assert list(ref) == stage_names(c.num_layers)
    hd = c.hidden_size // c.num_heads
    assert ref["ctx"].shape == (b, c.window, c.hidden_size)
    assert ref["L0.ctx_kv"].shape == (b, c.window, 2 * c.num_kv_heads * hd)
    assert ref["L1.qkv"].shape == (b, 5, (c.num_heads + 2 * c.num_kv_heads) * hd)
    assert ref["L0.attn_probs"].shape == (b, c.num_heads, 5, c.window + 5)
    assert ref["L1.mlp_act"].shape == (b, 5, c.ffn)
    assert ref["markov.logits"].shape == (b, 5, c.vocab_size)
    assert ref["draft.tokens"].dtype == torch.int64
    assert all(v.dtype == torch.float64 for k, v in ref.items() if k != "draft.tokens")


def test_stage_zero_attention_by_hand():
    """Layer 0's probabilities from q, k by explicit loops: RoPE from its formula, masked
    context positions exactly zero, every row a distribution."""
    model, inputs, ref = case(seed=1)
    c = model.config
    h, kvh, d = c.num_heads, c.num_kv_heads, c.hidden_size // c.num_heads
    qkv, kv = ref["L0.qkv"].numpy(), ref["L0.ctx_kv"].numpy()
    pos_b = inputs.anchor_pos[:, None].numpy() + np.arange(5)
    # angles in float32, as remote_drafter.models.llama_layers.rotate defines them (at positions near
    # 2e5 a float32 angle is off by ~1e-2 rad from the exact one: part of the function)
    inv = np.float32(1.0) / (np.float32(c.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))

    def rope(x, p):  # x [d] at position p
        a = (np.float32(p) * inv).astype(np.float64)
        x1, x2 = x[: d // 2], x[d // 2:]
        return np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)])

    probs = ref["L0.attn_probs"].numpy()
    for b in range(3):
        for head in range(h):
            g = head // (h // kvh)
            keys = [(rope(kv[b, j, g * d:(g + 1) * d], inputs.ctx_pos[b, j].item()), bool(inputs.ctx_valid[b, j]))
                    for j in range(c.window)]
            keys += [(rope(qkv[b, j, h * d + g * d: h * d + (g + 1) * d], pos_b[b, j]), True) for j in range(5)]
            for i in range(5):
                q = rope(qkv[b, i, head * d:(head + 1) * d], pos_b[b, i])
                s = np.array([q @ k / np.sqrt(d) if ok else -np.inf for k, ok in keys])
                p = np.exp(s - s.max())
                np.testing.assert_allclose(probs[b, head, i], p / p.sum(), rtol=2e-5, atol=1e-7)
    masked = ~inputs.ctx_valid[:, None, None, :].expand(3, h, 5, c.window)
    assert (ref["L0.attn_probs"][..., : c.window][masked] == 0).all() and masked.any()


def test_projections_norms_head_and_markov_chain_by_hand():
    model, inputs, ref = case(seed=2)
    c, w = model.config, {k: v.double().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_allclose(ref["ctx"].numpy(), inputs.ctx.double().numpy() @ w["ctx_proj.weight"].T, rtol=1e-12)
    ctx = rms(ref["ctx"].numpy(), w["ctx_norm.weight"], c.rms_norm_eps)
    kd = (c.hidden_size // c.num_heads) * c.num_kv_heads
    p = "layers.0.self_attn."
    close(ref["L0.ctx_kv"], np.concatenate([ctx @ w[p + "k_proj.weight"].T, ctx @ w[p + "v_proj.weight"].T], -1), 1e-6)
    assert kd == ref["L0.ctx_kv"].shape[-1] // 2
    m = "layers.1.mlp."
    x = rms(ref["L1.attn_resid"].numpy(), w["layers.1.post_attention_layernorm.weight"], c.rms_norm_eps)
    gate, up = x @ w[m + "gate_proj.weight"].T, x @ w[m + "up_proj.weight"].T
    close(ref["L1.mlp_act"], gate / (1 + np.exp(-gate)) * up, 1e-6)
    head = model.head.double().numpy()
    z = rms(ref["L1.out"].numpy(), w["norm.weight"], c.rms_norm_eps) @ head.T
    close(ref["head.logits"], z, 1e-6)
    w1, w2, z = w["markov.w1.weight"], w["markov.w2.weight"], ref["head.logits"].numpy()
    for b in range(3):
        prev = int(inputs.anchor[b])
        for i in range(5):
            logits = z[b, i] + np.array([sum(w1[prev, r] * w2[v, r] for r in range(c.markov_rank))
                                         for v in range(c.vocab_size)])
            np.testing.assert_allclose(ref["markov.logits"][b, i].numpy(), logits, rtol=1e-12, atol=1e-12)
            prev = int(np.argmax(logits))
            assert ref["draft.tokens"][b, i] == prev


def test_hooks_change_nothing_and_probs_reproduce_the_modules_attention():
    model, inputs, _ = case(seed=3)
    z = model.block_logits(inputs.ctx, inputs.ctx_valid, inputs.ctx_pos, inputs.anchor, inputs.anchor_pos)
    ref32 = staged_round(model, inputs)
    assert torch.equal(ref32["head.logits"].float(), z)  # bit for bit: the same module ran
    ref = staged_round(as_dtype(model, torch.float64), f64(inputs))
    c = model.config
    d, group = c.hidden_size // c.num_heads, c.num_heads // c.num_kv_heads
    v_ctx = ref["L0.ctx_kv"][..., c.num_kv_heads * d:]
    v_blk = ref["L0.qkv"][..., (c.num_heads + c.num_kv_heads) * d:]
    v = torch.cat([v_ctx, v_blk], 1).view(3, c.window + 5, c.num_kv_heads, d).transpose(1, 2)
    out = (ref["L0.attn_probs"] @ v.repeat_interleave(group, 1)).transpose(1, 2).reshape(3, 5, -1)
    # the module's attention runs in float32 inside (remote_drafter.models.llama_layers.Attention)
    torch.testing.assert_close(out, ref["L0.attn"], rtol=1e-5, atol=1e-6)


def test_reference_drafts_equal_the_torch_drafters():
    from remote_drafter.engine.history import History
    model = tiny_model(seed=5)
    drafter = DSparkDrafter(model.config, model, Manifest(kind="dspark"), "cpu")
    rng = np.random.default_rng(0)
    requests = []
    for n in (40, 9, 2):
        h = History(drafter.history_tokens, drafter.window, drafter.feature)
        h.reset(rng.integers(0, 500, n).astype(np.int32), rng.standard_normal((n - 1, drafter.feature)).astype(np.float32))
        requests.append(DraftRequest(h, 5))
    drafts = drafter.draft(requests, want_probs=False)
    from native_drafter.staged_round import inputs_from_requests
    ref = staged_round(as_dtype(model, torch.float64), f64(inputs_from_requests(drafter, requests)))
    assert np.array_equal(np.stack([d.tokens for d in drafts]), ref["draft.tokens"].numpy())
