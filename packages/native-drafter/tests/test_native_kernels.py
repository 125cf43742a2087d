"""The Triton kernels against the float64 reference, on tiny shapes: under TRITON_INTERPRET=1
on machines without a GPU (CI), compiled on a GPU. CUDA-graph capture and replay need a GPU:
benchmarks/kernels.sh covers them (the latency phase replays captured rounds)."""

import functools

import pytest
import torch
from native_kernel_support import DEVICE, tiny_model

from native_drafter import kernels as K
from native_drafter.kernel_gate import Case, random_inputs, run_case
from native_drafter.native import NativeRound
from native_drafter.staged_round import stage_names


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tiles", [K.ROOMY, K.COMPACT], ids=["roomy", "compact"])
@pytest.mark.parametrize("m,k,n", [(5, 40, 24), (33, 96, 70), (130, 64, 16)])
def test_linear_with_each_fusion(m, k, n, tiles):
    g = torch.Generator().manual_seed(m)
    x, w, w2 = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (n, k)))
    norm, resid = torch.rand(k, generator=g) + 0.5, torch.randn(m, n, generator=g)
    y = torch.full((m, n), float("nan"))
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    linear = functools.partial(K.linear, tiles=tiles)
    xd = x.double()
    normed = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * norm.double()
    assert rel(linear(dev(x), dev(w), dev(y)).cpu(), xd @ w.double().T) < 1e-6
    assert rel(linear(dev(x), dev(w), dev(y), resid=dev(resid)).cpu(), xd @ w.double().T + resid.double()) < 1e-6
    assert rel(linear(dev(x), dev(w), dev(y), norm=dev(norm), eps=1e-5).cpu(), normed @ w.double().T) < 1e-6
    a, b = normed @ w.double().T, normed @ w2.double().T
    got = linear(dev(x), dev(w), dev(y), norm=dev(norm), eps=1e-5, w2=dev(w2)).cpu()
    assert rel(got, torch.nn.functional.silu(a) * b) < 1e-6


@pytest.mark.parametrize("batch,width", [(1, 3), (3, 5), (2, 8)])
def test_every_stage_of_the_round_within_tolerance(batch, width):
    model = tiny_model(seed=batch * 10 + width, width=width).to(DEVICE)
    case = Case(f"tiny-b{batch}-w{width}", model, random_inputs(model.config, batch, torch.Generator().manual_seed(width)))
    report = run_case(case, DEVICE)
    assert report.passed, [c for c in report.checks if not c.passed]
    names = {c.name.split("/", 1)[1] for c in report.checks}
    assert names == set(stage_names(model.config.num_layers))
    assert max(c.error for c in report.checks) < 1e-5  # float32 arithmetic: far under the tolerances


def test_the_compact_tiles_pass_the_gate_as_the_roomy_ones_do():
    """A card with less shared memory a program (an RTX 3090) takes COMPACT's tiles: the same
    round within the same tolerances and the same drafts, over a window of several key steps
    (80 keys: two steps of ROOMY's, three of COMPACT's) and several row blocks (240 rows)."""
    model = tiny_model(seed=5, window=80).to(DEVICE)
    case = Case("tiles", model, random_inputs(model.config, 3, torch.Generator().manual_seed(2)))
    for tiles in (K.ROOMY, K.COMPACT):
        report = run_case(case, DEVICE, native_cls=functools.partial(NativeRound, tiles=tiles))
        assert report.passed, (tiles, [c for c in report.checks if not c.passed])
        assert max(c.error for c in report.checks) < 1e-5
    assert NativeRound(model).tiles == K.tiles_for(DEVICE)


def test_a_card_with_less_shared_memory_a_program_takes_the_compact_tiles(monkeypatch):
    """An H200 gives a program 227 KiB, an RTX 3090 99 (what Triton's driver reports)."""
    monkeypatch.setattr(K, "_max_shared", {0: 232448, 1: 101376}.__getitem__)
    K._tiles_on.cache_clear()
    try:
        assert K.tiles_for("cuda:0") is K.ROOMY and K.tiles_for("cuda:1") is K.COMPACT
        assert K.tiles_for("cpu") is K.ROOMY  # Triton's interpreter: no limit
    finally:
        K._tiles_on.cache_clear()


def test_token_only_context_too():
    """Token-only drafters (no hidden rows): the context is the committed tokens' embeddings."""
    model = tiny_model(seed=7, target_layers=[], target_hidden_size=0).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    inputs = random_inputs(model.config, 2, g)
    inputs.ctx = torch.randint(0, 511, inputs.ctx_valid.shape, generator=g)
    assert run_case(Case("token-only", model, inputs), DEVICE).passed


def test_markov_argmax_takes_the_first_of_equal_logits_and_flags_nan():
    v, r = 700, 8
    z = torch.randn(2, v)
    z[0, [5, 300, 650]] = 50.0     # an exact three-way tie across tiles: torch.argmax's choice is 5
    z[1, 123] = float("nan")
    w1, w2 = torch.zeros(v, r), torch.zeros(v, r)  # no correction: the tie stays exact
    out, tokens = torch.empty(2, v), torch.full((2,), -1)
    tiles = -(-v // K.MARKOV_BV)
    best_v, best_i = torch.empty(2, tiles), torch.empty(2, tiles, dtype=torch.int32)
    K.markov(z.to(DEVICE), torch.tensor([1, 2], device=DEVICE), w1.to(DEVICE), w2.to(DEVICE), out.to(DEVICE),
             best_v.to(DEVICE), best_i.to(DEVICE), t := tokens.to(DEVICE))
    assert t[0].item() == int(z[0].argmax()) == 5
    assert not 0 <= t[1].item() < v  # NaN: no valid token, the gate's range check fails it


def test_float32_only():
    with pytest.raises(ValueError, match="float32"):
        NativeRound(tiny_model().to(torch.bfloat16))
