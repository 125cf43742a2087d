"""The drafter round's Triton kernels (models/dsv41/kernels.py) against the torch code they
replace (the mix module's pre / post, the numerics' norm and RoPE, pick.top_two), on the tiny V4.1 and V4 checkpoints:
every output within float32 rounding, and the drafter's greedy drafts unchanged. Without a
GPU (CI) the kernels run in Triton's CPU interpreter; with one (the GPU tier, gpu.sh) they
are compiled. Needs Triton: remote-drafter[test] installs it."""

import os
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")
if not torch.cuda.is_available():  # before Triton defines a kernel: it picks interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="needs Triton: remote-drafter[test] installs it")

from remote_drafter.engine.identity import Manifest  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint, kernels, tiny  # noqa: E402
from remote_drafter.models.dsv41.drafter import GRAPH_BATCHES, Dsv41Drafter  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402
from remote_drafter.models.dsv41.modules.attention import unseen_keys  # noqa: E402
from remote_drafter.models.dsv41.modules.mix import HyperMix  # noqa: E402
from remote_drafter.models.dsv41.modules.module import Weights  # noqa: E402
from remote_drafter.models.dsv41.modules.numerics import Numerics  # noqa: E402
from remote_drafter.models.pick import top_two  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MANIFEST = Manifest("tiny", "tiny", "tiny", "tiny", Dsv41Drafter.kind)


@pytest.fixture(scope="module", params=["v41", "v4"])
def loaded(tmp_path_factory, request):
    folder = str(tmp_path_factory.mktemp(request.param))
    tiny.write_tiny(folder, variant=request.param)
    return checkpoint.load(folder, torch.float32, "cpu")


def model(loaded, dtype=torch.float32, **config) -> Dsv41Model:
    return Dsv41Model(replace(loaded.config, **config), loaded.weights, DEVICE, dtype=dtype)


def both(m: Dsv41Model, fn, *args):
    """(torch's result, the kernels' result) of fn(*args), fn one of m's modules' methods."""
    assert m.use_kernels(False) == "not asked to" and m.numerics.kernels is None
    want = fn(*args)
    m.numerics.kernels = kernels  # as use_kernels sets it after its check (tested below)
    got = fn(*args)
    m.numerics.kernels = None
    return want, got


def stream(m: Dsv41Model, rows=(2, 3), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = m.config
    return torch.randn(*rows, c.hc_mult, c.hidden_size, generator=g).to(DEVICE, m.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("carried", ["none", "previous"])
@pytest.mark.parametrize("iters", [20, 2])
def test_hc_pre_kernel_is_the_torch_mix(loaded, dtype, carried, iters):
    """The normed collapse, post, comb (Sinkhorn-normalised) and pre weights of every
    sublayer, for layer 0's attention (no carried pre) and the others; with the checkpoint's
    20 Sinkhorn iterations and with 2 (far from converged: a miscount would show)."""
    m = model(loaded, dtype, hc_sinkhorn_iters=iters)
    residual = stream(m)
    pre = None if carried == "none" else torch.rand(2, 3, m.config.hc_mult, device=DEVICE) + 0.5
    for layer in m.layers:
        for mix in (layer.attn_mix, layer.ffn_mix):
            want, got = both(m, mix.pre, residual, pre)
            for name, a, b in zip(("x", "post", "comb", "pre"), want, got):
                assert a.shape == b.shape and a.dtype == b.dtype, name
                # float32: rounding; the collapse in bf16: one bf16 step of its largest values
                tol = 1e-5 if a.dtype == torch.float32 else 2 ** -7
                assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * a.abs().max().item()), name
            if iters == 20:  # doubly stochastic by then
                assert torch.allclose(got[2].sum(-1), torch.ones_like(got[2].sum(-1)), atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_kernel_adds_the_slices_of_a_wide_stream(loaded, dtype):
    """A stream several of the mixes' slices wide, the last one partial (the tiny model's
    fits in one): the same mix as torch's."""
    width = 1100
    c = replace(loaded.config, hidden_size=width)
    k, g = c.hc_mult, torch.Generator().manual_seed(5)
    assert k * width > kernels.MIX_SLICE * 4 and (k * width) % kernels.MIX_SLICE
    tensors = {"mtp.0.hc_attn_fn": torch.randn(c.mix_hc, k * width, generator=g) * 0.02,
               "mtp.0.hc_attn_scale": torch.rand(3, generator=g) + 0.5,
               "mtp.0.hc_attn_base": torch.randn(c.mix_hc, generator=g),
               "mtp.0.attn_norm.weight": (torch.rand(width, generator=g) + 0.5).to(dtype)}
    numerics = Numerics(c, dtype, torch.device(DEVICE))
    mix = HyperMix(numerics, Weights({n: t.to(DEVICE) for n, t in tensors.items()}, {}), "mtp.0.", "attn")
    residual = torch.randn(3, k, width, generator=g).to(DEVICE, dtype)
    carried = torch.rand(3, k, generator=g).to(DEVICE) + 0.5
    want = mix.pre(residual, carried)
    numerics.kernels = kernels
    got = mix.pre(residual, carried)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for name, a, b in zip(("x", "post", "comb", "pre"), want, got):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * a.abs().max().item()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_kernel_is_the_torch_mix(loaded, dtype):
    m = model(loaded, dtype)
    residual, c = stream(m), m.config
    mix = m.layers[0].attn_mix
    _, post, comb, _ = mix.pre(residual, None)
    out = torch.randn(2, 3, c.hidden_size, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    want, got = both(m, mix.post, out, residual, post, comb)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(want.float(), got.float(), rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_norm_kernels_are_torchs(loaded, dtype):
    """RoPE there and back, one position per row and one shared by a row's heads, on a
    non-contiguous input too, at positions up to 300K; the RMS norm with and without a weight."""
    m, c = model(loaded, dtype), loaded.config
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, c.num_attention_heads, c.head_dim, generator=g).to(DEVICE, dtype)
    kv = torch.randn(7, c.head_dim, generator=g).to(DEVICE, dtype)
    heads = torch.randint(0, 300_000, (2, 3), generator=g).to(DEVICE)
    rows = torch.randint(0, 300_000, (7,), generator=g).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    checks = [("rope", q, heads, False), ("rope", q, heads, True), ("rope", kv, rows, False),
              ("rope", q.transpose(1, 2).transpose(1, 2), heads, True),
              ("rope", q.permute(0, 2, 1, 3), torch.randint(0, 9, (2, c.num_attention_heads), generator=g).to(DEVICE), False),
              ("norm", q, None), ("norm", kv, m.layers[0].attention.kv_norm)]
    for method, *args in checks:
        want, got = both(m, getattr(m.numerics, method), *args)
        assert got.shape == want.shape and got.dtype == want.dtype, method
        assert torch.allclose(want.float(), got.float(), rtol=tol, atol=tol * want.abs().max().item()), method


def attention_inputs(m: Dsv41Model, dtype: torch.dtype, ctx_rows: int = 37) -> tuple:
    """q, two layers' window rows, the new rows, unseen keys and the sinks of three requests:
    a full context, some padding and none (the block alone)."""
    c, g = m.config, torch.Generator().manual_seed(3)
    b, w, heads, d = 3, c.block_size, c.num_attention_heads, c.head_dim
    q = torch.randn(b, w, heads, d, generator=g).to(DEVICE, dtype)
    windows = torch.randn(b, ctx_rows, 2, d, generator=g).to(DEVICE, dtype)  # two layers' rows
    new = torch.randn(b, w, d, generator=g).to(DEVICE, dtype)
    kept = torch.tensor([ctx_rows, 5, 0], device=DEVICE)
    unseen = unseen_keys(torch.arange(ctx_rows, device=DEVICE) >= ctx_rows - kept[:, None], w)
    return q, windows, new, unseen, m.layers[0].attention.sink


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_kernel_is_torchs(loaded, dtype):
    """The window's attention: requests with a full context, some padding and none (the
    block alone), a context spanning several of the kernel's key steps, its rows one layer's
    of the windows (strided), query rows past the kernel's last full block, each head's sink."""
    m, c = model(loaded, dtype), loaded.config
    q, windows, new, unseen, sink = attention_inputs(m, dtype)
    w, ctx_rows = c.block_size, windows.shape[1]
    assert (w * c.num_attention_heads) % kernels.ATTEND_ROWS and ctx_rows + w > 2 * kernels.ATTEND_KEYS
    want, got = both(m, m.numerics.attend, q, windows[:, :, 1], new, unseen, sink)
    assert got.shape == want.shape == q.shape and got.dtype == want.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert torch.allclose(want.float(), got.float(), rtol=tol, atol=tol * want.abs().max().item())
    # the keys split over 2 and 3 programs a block of rows (the third request's first split
    # sees no key), joined with the sink by a second launch
    for splits in (2, 3):
        split = kernels.attend(q, windows[:, :, 1], new, unseen, sink, splits=splits)
        assert torch.allclose(want.float(), split.float(), rtol=tol, atol=tol * want.abs().max().item()), splits
    # the padding is left out: changing it changes nothing
    windows[1, :ctx_rows - 5] = 100.0
    m.numerics.kernels = kernels
    assert torch.equal(m.numerics.attend(q, windows[:, :, 1], new, unseen, sink), got)
    m.numerics.kernels = None


def test_every_attention_variant_is_torchs(loaded):
    """Every form of the kernel a round may run (on the CPU the weighted sum is float32
    whatever its dot's precision asked for on a GPU): each equals torch's attention."""
    m = model(loaded, torch.bfloat16)
    q, windows, new, unseen, sink = attention_inputs(m, torch.bfloat16)
    want = m.numerics.attend(q, windows[:, :, 1], new, unseen, sink)
    for name, options in kernels.ATTEND_VARIANTS.items():
        got = kernels.attend(q, windows[:, :, 1], new, unseen, sink, **options)
        assert torch.allclose(want.float(), got.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item()), name


def test_the_fastest_attention_form_that_matches_torch_serves_at_each_batch(loaded, monkeypatch):
    """choose_attention times every form that matched torch at each batch and the fastest
    serves there: a faster form that computes something else, raises, or cannot be timed
    never does; a batch between those chosen takes the next larger one's form, a batch past them the
    largest's. (Timed here by a stand-in clock; the GPU tier times in CUDA graphs.)"""
    m = model(loaded, torch.bfloat16)
    assert m.use_kernels() is None
    right, calls = kernels.attend, []

    def attend(*args, **form):
        calls.append((len(args[0]), form))
        if form.get("splits") == 9:
            raise RuntimeError("no such kernel here")
        return right(*args, **form) * (1.05 if form.get("splits") == 2 else 1.0)
    monkeypatch.setattr(kernels, "attend", attend)
    ms = {1: {"2 splits": 0.1, "9 splits": 0.1, "3 splits, tf32x3": 0.1, "3 splits": 0.5, "default": 1.0},
          4: {"2 splits": 0.1, "9 splits": 0.1, "3 splits, tf32x3": 0.1, "tf32x3": 0.7, "default": 0.8}}

    def clock(fn):
        fn()
        batch, form = calls[-1]
        name = next(n for n, f in kernels.ATTEND_VARIANTS.items() if f == form)
        if name == "3 splits, tf32x3":
            raise RuntimeError("not capturable here")  # as a form a GPU cannot capture would
        return ms[batch].get(name, 2.0)
    assert m.choose_attention([1, 4], clock) == {1: "3 splits", 4: "tf32x3"}
    q, windows, new, unseen, sink = attention_inputs(m, torch.bfloat16)
    for batch, form in ((1, {"splits": 3}), (2, {"weighted_sum": "tf32x3"}), (3, {"weighted_sum": "tf32x3"})):
        m.numerics.attend(q[:batch], windows[:batch, :, 1], new[:batch], unseen[:batch], sink)
        assert calls[-1] == (batch, form)
    m.numerics.attend(*(torch.cat([x] * 3) for x in (q, windows[:, :, 1], new, unseen)), sink)
    assert calls[-1] == (9, {"weighted_sum": "tf32x3"})  # past every batch chosen: the largest's
    # the kernel checked again (another drafter of the model): the forms chosen stand
    assert m.use_kernels() is None and m.numerics.attend_chosen == {1: "3 splits", 4: "tf32x3"}


def test_the_attention_form_is_the_kernels_defaults_when_asked_and_chosen_once_a_model(loaded, monkeypatch):
    """REMOTE_DRAFTER_ATTENTION=default keeps the kernel's defaults at every batch (nothing
    timed); a later drafter of the same model keeps what the first chose (its graphs run it);
    a value the variable does not take stops the drafter by name; status says what attends."""
    m = model(loaded, torch.bfloat16)
    d = Dsv41Drafter(m, MANIFEST, DEVICE)
    assert m.use_kernels() is None
    m.numerics.attend_chosen = None  # as a model no drafter has chosen for
    monkeypatch.setenv("REMOTE_DRAFTER_ATTENTION", "default")
    d._choose_attention()
    assert m.numerics.attend_chosen == {} and d.describe()["attention"] == "the kernel's defaults"
    m.numerics.attend_chosen = {1: "3 splits"}  # an earlier drafter's choice
    d._choose_attention()
    assert d.describe()["attention"] == {1: "3 splits"}
    monkeypatch.setenv("REMOTE_DRAFTER_ATTENTION", "fastest")
    with pytest.raises(ValueError, match="REMOTE_DRAFTER_ATTENTION='fastest': one of auto, default"):
        d._choose_attention()
    assert m.use_kernels(False) == "not asked to" and d.describe()["attention"] == "torch attends"


def test_drafts_with_the_kernels_are_torchs(loaded):
    """A float32 drafter drafts the same greedy tokens with the kernels as without."""
    m = model(loaded)
    d = Dsv41Drafter(m, MANIFEST, DEVICE, round_kernels=False)
    assert d.describe()["round_kernels"].startswith("torch")
    rng = np.random.default_rng(3)
    requests = []
    for i in range(4):
        h = d.new_history()
        n = 20 + 17 * i
        h.reset(rng.integers(0, d.vocab_size - 1, n).astype(np.int32),
                rng.standard_normal((n - 1, d.feature)).astype(np.float32))
        requests.append(DraftRequest(h, d.max_depth))
    want = d.draft(requests, False)
    if DEVICE == "cpu":  # the drafter takes the kernels on CUDA only
        assert m.use_kernels() is None
    fused = Dsv41Drafter(m, MANIFEST, DEVICE)
    assert fused.describe()["round_kernels"] == "triton (mHC, RoPE, norms, routers, top two, attention)"
    got = fused.draft(requests, False)
    assert [a.tokens.tolist() for a in want] == [b.tokens.tolist() for b in got]
    assert np.allclose([a.own_probs for a in want], [b.own_probs for b in got], atol=1e-4)
    if DEVICE == "cuda":  # the GPU tier: the kernels inside the round's CUDA graphs too
        graphed = Dsv41Drafter(m, MANIFEST, DEVICE, cuda_graphs=True)
        assert graphed.describe()["cuda_graphs"] != "off (eager rounds)"
        # the attention's form timed at every captured batch (REMOTE_DRAFTER_ATTENTION=auto)
        chosen = graphed.describe()["attention"]
        assert set(chosen) == set(GRAPH_BATCHES) and set(chosen.values()) <= set(kernels.ATTEND_VARIANTS)
        assert [a.tokens.tolist() for a in want] == [b.tokens.tolist() for b in graphed.draft(requests, False)]


def test_kernels_serve_only_after_matching_torch(loaded, monkeypatch):
    """use_kernels compares the kernels with torch on the model's first layer and rows of
    random logits (with and without a bias): they serve when they match, and a kernel that
    computes something else is refused by name (torch serves on)."""
    m = model(loaded, torch.bfloat16)
    assert m.use_kernels() is None and m.numerics.kernels is kernels
    right_post, right_top = kernels.hc_post, kernels.top_two
    monkeypatch.setattr(kernels, "hc_post", lambda *a: right_post(*a) * 1.05)
    why = m.use_kernels()
    assert why.startswith("the kernels' stream differs from torch's") and m.numerics.kernels is None
    monkeypatch.setattr(kernels, "hc_post", lambda *a: 1 / 0)
    assert m.use_kernels() == "ZeroDivisionError: division by zero" and m.numerics.kernels is None
    monkeypatch.setattr(kernels, "hc_post", right_post)
    monkeypatch.setattr(kernels, "top_two", lambda x, b=None: (right_top(x, b)[0], right_top(x, b)[1].flip(-1)))
    assert m.use_kernels().startswith("the kernels' top-two tokens") and m.numerics.kernels is None
    # a kernel that drops the Markov head's bias is refused too
    monkeypatch.setattr(kernels, "top_two", lambda x, b=None: right_top(x))
    assert m.use_kernels().startswith("the kernels' biased top-two") and m.numerics.kernels is None
    monkeypatch.setattr(kernels, "top_two", right_top)
    right_route = kernels.route  # and a router that drops the gate's bias
    monkeypatch.setattr(kernels, "route", lambda x, bias, *a: right_route(x, None, *a))
    assert m.use_kernels().startswith(("the kernels' routing weights", "the kernels' routed experts")) and m.numerics.kernels is None


def test_an_attention_kernel_that_fails_leaves_torch_attending_beside_the_other_kernels(loaded, monkeypatch):
    """The attention kernel is checked apart: one that computes something else, or raises, is
    refused by name, torch attends, the other kernels serve on, and status says so."""
    m = model(loaded, torch.bfloat16)
    assert m.use_kernels() is None and m.numerics.attention_refusal is None
    right = kernels.attend
    monkeypatch.setattr(kernels, "attend", lambda *a: right(*a) * 1.05)
    assert m.use_kernels() is None and m.numerics.kernels is kernels
    assert m.numerics.attention_refusal.startswith("it differs from torch's by")
    calls = []
    monkeypatch.setattr(kernels, "attend", lambda *a: calls.append(a) or 1 / 0)
    d = Dsv41Drafter(m, MANIFEST, DEVICE)
    if DEVICE == "cpu":  # the drafter takes the kernels on CUDA only
        assert m.use_kernels() is None
    assert m.numerics.attention_refusal == "ZeroDivisionError: division by zero" and len(calls) == 1
    assert d.describe()["round_kernels"] == ("triton (mHC, RoPE, norms, routers, top two); torch attends "
                                             "(ZeroDivisionError: division by zero)")
    layer, g = m.layers[0], torch.Generator().manual_seed(4)
    x = torch.randn(1, m.config.block_size, m.config.hidden_size, generator=g).to(DEVICE, m.dtype)
    positions = torch.arange(m.config.block_size, device=DEVICE)[None]
    ctx = torch.zeros(1, 0, m.config.head_dim, dtype=m.dtype, device=DEVICE)
    layer.attention(x, positions, ctx, unseen_keys(torch.ones(1, 0, dtype=torch.bool, device=DEVICE), m.config.block_size))
    assert len(calls) == 1  # the round attends in torch: the kernel is not called again


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("norm", [True, False])
def test_route_kernel_is_the_torch_router(loaded, scoring, norm):
    """Layer 0's router with the kernel and in torch, at every scoring function, with and
    without renormalising: the same experts in the same order, the weights within float32
    rounding, on rows whose products with the gate reach far past softplus's threshold of 20
    both ways (where log(1 + exp(x)) alone would lose what log1p keeps)."""
    m = model(loaded, scoring_func=scoring, norm_topk_prob=norm)
    moe = m.layers[0].moe
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(9, m.config.hidden_size, generator=g).to(DEVICE)
    rows[0] *= 60 / float((rows[0] @ moe.gate.T.float()).abs().max())
    rows[1] = -rows[0]  # products past softplus's threshold of 20, and as far below zero
    want, got = both(m, moe.route, rows)
    assert torch.equal(got[1].cpu(), want[1].cpu()) and got[1].dtype == torch.int64
    assert got[0].dtype == want[0].dtype == torch.float32
    assert torch.allclose(got[0].cpu(), want[0].cpu(), rtol=2e-6, atol=0)
    logits = (rows @ moe.gate.T).float()
    assert logits.max() > 20 and logits.min() < -20


@pytest.mark.parametrize("bias", [True, False])
def test_route_kernel_at_widths_past_its_blocks_and_its_tie_rule(bias):
    """kernels.route where the experts (100) and the choices (6) are not powers of two (the
    masked lanes), with and without a bias: torch's experts in torch's order and its weights
    within float32 rounding on logits with no ties; where scores tie, the lowest expert."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, 100, generator=g) * 3).to(DEVICE)
    b = (torch.randn(100, generator=g) * 0.1).to(DEVICE) if bias else None
    weights, experts = kernels.route(logits, b, 6, "sigmoid", True, 2.5)
    scores = logits.sigmoid()
    want = (scores + b if bias else scores).topk(6, dim=-1).indices
    picked = scores.gather(-1, want)
    assert torch.equal(experts.cpu(), want.cpu())
    assert torch.allclose(weights.cpu(), (picked / picked.sum(-1, keepdim=True) * 2.5).cpu(), rtol=2e-6, atol=0)
    tied = torch.zeros(1, 100, device=DEVICE)
    tied[0, [90, 40, 70]] = 5.0  # three equal scores above the rest
    assert kernels.route(tied, None, 2, "sigmoid", True, 1.0)[1].tolist() == [[40, 70]]


@pytest.mark.parametrize("vocab", [129280, 1024, 4097, 3])
def test_top_two_kernel_is_torchs(vocab):
    """The vocabulary split over programs and joined: the same two tokens as pick.top_two
    and their probabilities within float32 rounding, at the Flash vocabulary, the tiny
    one, one past a slice and a vocabulary smaller than a slice; ties go to the lower token,
    as torch's max on the CPU."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(DEVICE)
    logits[1, vocab // 2] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie across slices
    logits[2, 0] = logits[2].max() + 3  # a certain token: the runner-up's probability tiny
    want_p, want_i = top_two(logits)
    got_p, got_i = kernels.top_two(logits)
    assert torch.equal(got_i.cpu(), want_i.cpu())
    assert torch.allclose(got_p.cpu(), want_p.cpu(), rtol=1e-5, atol=1e-12)
    assert got_i[1].tolist() == [vocab // 2, vocab - 1]


@pytest.mark.parametrize("vocab", [129280, 4097])
def test_top_two_kernel_adds_a_bias_as_it_reads_a_row(vocab):
    """A block's row of logits (rows apart in memory, read in place) plus a bf16 bias, added in
    float32 as the kernel reads them: the same tokens as pick.top_two of the sum torch makes
    (one rounding each way: the same logits), the probabilities within float32 rounding; and
    against the kernel on that sum, the same tokens and probabilities within float32 rounding
    (not bit for bit: the two compiled variants may sum a slice in another order), where the
    sum rounded to bf16 would part thousands of times more."""
    g = torch.Generator().manual_seed(vocab)
    block = (torch.randn(4, 3, vocab, generator=g) * 4).to(DEVICE)  # [B, W, V]: row i of each is z[:, i]
    bias = (torch.randn(4, vocab, generator=g) * 4).to(DEVICE, torch.bfloat16)
    for i in range(3):
        want_p, want_i = top_two(block[:, i] + bias.float())
        got_p, got_i = kernels.top_two(block[:, i], bias)
        assert torch.equal(got_i.cpu(), want_i.cpu())
        assert torch.allclose(got_p.cpu(), want_p.cpu(), rtol=1e-5, atol=1e-12)
        summed_p, summed_i = kernels.top_two(block[:, i] + bias.float())  # the same logits, bit for bit
        assert torch.equal(got_i, summed_i)
        parted = ((got_p - summed_p).abs() / summed_p).max().item()
        assert parted <= 1e-5, f"probabilities part from the kernel's on the sum by {parted:.2e} relative"
    with pytest.raises(ValueError, match="a bias of shape"):
        kernels.top_two(block[:, 0], bias[0])


def test_the_launch_counter_counts_a_rounds_kernels_by_line(tmp_path):
    """benchmarks/round_launches.py on the tiny bf16 drafter with the round's Triton kernels:
    each Triton launch counted once (not the torch work the interpreter runs a kernel with),
    so each kernel as often as the round's structure says; the casts between bf16 and float32
    counted, views not; every launch attributed to a line of remote_drafter."""
    import json

    from benchmark_scripts import load
    from triton.runtime.jit import KernelInterface
    script = load("round_launches")
    getitem = KernelInterface.__getitem__
    out = tmp_path / "launches.json"
    assert script.main(["--batches", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    r = result["batches"]["1"]
    ops, c = r["by_op"], tiny.tiny_config()["text_config"]
    layers, steps = c["n_mtp_layers"], c["dspark_block_size"]
    assert ops["triton._hc_pre_kernel"] == ops["triton._hc_post_kernel"] == 2 * layers  # two sublayers each
    assert ops["triton._top_two_part_kernel"] == ops["triton._top_two_join_kernel"] == steps  # a greedy step each
    assert ops["aten._to_copy"] > 0 and not {"aten.view", "aten._unsafe_view", "aten.empty"} & set(ops)
    assert r["launches"] == sum(ops.values()) == sum(r["by_line"].values())
    assert all(line.startswith("models/") for line in r["by_line"])
    assert KernelInterface.__getitem__ is getitem


def test_the_launch_counter_counts_our_exl3_experts_layer_in_eight_launches():
    """round_launches.count_experts: with the plan's kernel our EXL3 experts' layer is its seven
    kernels and the plan (one), where torch's sort takes some two dozen launches more."""
    from benchmark_scripts import load
    counts = load("round_launches").count_experts(5, top_k=2, experts=4)  # few: the interpreter is slow
    assert counts["plan kernel"]["by_op"] == {"triton._expert_tiles_kernel": 3, "triton._rows_in_kernel": 2,
                                              "triton._plan_kernel": 1, "triton._activation_kernel": 1,
                                              "triton._combine_kernel": 1}
    assert counts["torch sort"]["launches"] >= 8 + 20 and "aten.sort" in counts["torch sort"]["by_op"]


def test_the_launch_counter_counts_what_reaches_the_device():
    """LaunchCounter on plain code: a cast and a sum counted, a view not, a host read counted
    as a sync, the top-two kernel's two launches and nothing of how the interpreter runs them;
    inference mode works again afterwards (the counter runs under no_grad)."""
    from benchmark_scripts import load
    script = load("round_launches")
    x = torch.ones(4, dtype=torch.bfloat16)
    logits = torch.randn(2, 5000).to(DEVICE)
    with script.LaunchCounter() as counter:
        with torch.inference_mode():
            total = x.to(torch.float32).view(2, 2).sum()
            total.item()
        kernels.top_two(logits)  # two launches, not the torch work the interpreter runs them with
    assert dict(counter.by_op) == {"aten._to_copy": 1, "aten.sum": 1, "triton._top_two_part_kernel": 1,
                                   "triton._top_two_join_kernel": 1}
    assert sum(counter.syncs.values()) == 1
    assert counter.by_line["(outside remote_drafter)"] == 2  # the cast and the sum
    assert sum(n for line, n in counter.by_line.items() if line.startswith("models/dsv41/kernels.py:")) == 2
    with torch.inference_mode():
        assert torch.is_inference_mode_enabled()
