"""models/exl3_triton.py's grouped product and models/exl3_triton_experts.py's MoE layer on it
(our own kernel on exllamav3's stored 4-bit trellis, each chosen expert decoded once), against
models/exl3_format.py's numpy reading of the same bytes: the product per expert within fp32
rounding (experts with no rows, more rows than the kernel takes at once, a split input), and
the whole layer (rotations, activation, routing weights, shared expert) against a float64
reference on exl3_format's weights. Without a GPU (CI) the kernel runs in Triton's CPU
interpreter; benchmarks/gpu.sh ONLY_DRAFTER_ROUND=moe runs these compiled on an H200, and sets
the layer against exllamav3's fused kernels there."""

import json
import os

import benchmark_scripts
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")
if not torch.cuda.is_available():  # before Triton defines a kernel: it picks interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="needs Triton: remote-drafter[test] installs it")

from remote_drafter.models import exl3_format, exl3_triton  # noqa: E402
from remote_drafter.models import exl3_triton_experts as layer_kernels  # noqa: E402
from remote_drafter.models.exl3_triton_experts import Stored, TritonExl3Experts, refusal  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, INTER, LIMIT = 256, 128, 7.0  # hidden and expert widths (multiples of 128), the SwiGLU limit


def random_linear(rng, n_in: int, n_out: int, bits: int = 4) -> Stored:
    """Random trellis bytes (every pattern is a valid trellis), signs for suh, small svh."""
    return Stored(torch.from_numpy(rng.integers(-2**15, 2**15, (n_in // 16, n_out // 16, 16 * bits), dtype=np.int16)).to(DEVICE),
                  torch.from_numpy(np.sign(rng.standard_normal(n_in)).astype(np.float16)).to(DEVICE),
                  torch.from_numpy((rng.random(n_out) * 0.05).astype(np.float16)).to(DEVICE))


def weight(s: Stored) -> np.ndarray:
    """float64 [in, out]: the linear's weight as exllamav3 reconstructs it."""
    return exl3_format.weight(s.trellis.cpu().numpy(), s.suh.cpu().numpy(), s.svh.cpu().numpy(), 4).astype(np.float64)


def swiglu(x: np.ndarray, three: tuple[Stored, Stored, Stored]) -> np.ndarray:
    """exllamav3's activation: min(silu(g), L) * clamp(u, -L, L), in float64."""
    g, u = x @ weight(three[0]), x @ weight(three[1])
    return (np.minimum(g / (1 + np.exp(-g)), LIMIT) * np.clip(u, -LIMIT, LIMIT)) @ weight(three[2])


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("nt, warps", sorted({(c["nt"], c["num_warps"]) for c in TritonExl3Experts.CONFIGS}))
def test_the_product_multiplies_each_experts_rows_by_its_decoded_weight(splits, nt, warps):
    """Every configuration the start-up tuning may choose (tile columns a program, warps: on
    Hopper 4 warps or more make wgmma, 2 mma.sync)."""
    rng = np.random.default_rng(splits)
    trellis = [random_linear(rng, 256, 256).trellis for _ in range(4)]
    # expert 1 has no rows; expert 2 more than one work item's; expert 3 exactly one's; then
    # the padding expert
    n = exl3_triton.ITEM_ROWS
    counts = [2, 0, n + 3, n, 0]
    starts = list(np.cumsum([0] + counts[:-1]))
    x = rng.standard_normal((sum(counts), 256)).astype(np.float16)
    table = torch.tensor([t.data_ptr() for t in trellis + trellis[:1]], dtype=torch.int64, device=DEVICE)
    counts_on = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    items = exl3_triton.work_items(counts_on, exl3_triton.max_items(sum(counts), 4))
    assert items[0].tolist() == [0, 2, 2, 3, 4, 4] and items[1].tolist()[:4] == [0, 0, n, 0]
    got = exl3_triton.expert_products(torch.from_numpy(x).to(DEVICE), items, table, counts_on,
                                      torch.tensor(starts, dtype=torch.int32, device=DEVICE), 256, 256,
                                      splits, nt=nt, num_warps=warps)
    assert got.shape[0] == splits
    got = got.sum(0).cpu().numpy()
    want = np.concatenate([x[s:s + c].astype(np.float64) @ exl3_format.decoded(t.cpu().numpy(), 4).astype(np.float64)
                           for t, c, s in zip(trellis, counts, starts)])
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def layer(seed: int, experts: int = 4, shared: bool = True):
    rng = np.random.default_rng(seed)
    routed = [(random_linear(rng, H, INTER), random_linear(rng, H, INTER), random_linear(rng, INTER, H)) for _ in range(experts)]
    common = (random_linear(rng, H, INTER), random_linear(rng, H, INTER), random_linear(rng, INTER, H)) if shared else None
    return routed, common, TritonExl3Experts(routed, common, LIMIT)


# 18 rows: the shared expert's slots take two work items
@pytest.mark.parametrize("rows,offered", [(18, None), (5, [1, 4, 5])], ids=["any expert", "three of six"])
def test_the_layer_is_the_routed_weighted_sum_plus_the_shared_expert(rows, offered):
    routed, shared, moe = layer(0, experts=6)
    rng = np.random.default_rng(1)
    k = 2
    offered = offered or range(len(routed))
    chosen = np.stack([rng.choice(offered, k, replace=False) for _ in range(rows)])
    weights = rng.random((rows, k)).astype(np.float32)
    x = rng.standard_normal((rows, H)).astype(np.float16)
    got = moe(torch.from_numpy(x).to(DEVICE), torch.from_numpy(weights).to(DEVICE),
              torch.from_numpy(chosen).to(DEVICE)).cpu().numpy()
    xd = x.astype(np.float64)
    want = swiglu(xd, shared)
    for r in range(rows):
        for j in range(k):
            want[r] += weights[r, j] * swiglu(xd[r:r + 1], routed[chosen[r, j]])[0]
    assert got.shape == (rows, H) and got.dtype == np.float32
    # the product's rows are rounded to fp16 after each rotation and the activation, as exllamav3's
    assert np.abs(got - want).max() <= 3e-3 * np.abs(want).max()


def test_the_fused_rotations_equal_torchs_rotations_around_the_product():
    """The layer's kernels besides the product (the rows in, the activation, the combination)
    against the same steps in torch (exl3_triton.rotated_in / rotated_out, in fp32), on a
    split product."""
    routed, shared, moe = layer(5, experts=3)
    rng = np.random.default_rng(6)
    rows, k, splits = 7, 2, 2
    x = torch.from_numpy(rng.standard_normal((rows, H)).astype(np.float16)).to(DEVICE)
    weights = torch.from_numpy(rng.random((rows, k)).astype(np.float32)).to(DEVICE)
    experts = torch.from_numpy(np.stack([rng.choice(3, k, replace=False) for _ in range(rows)])).to(DEVICE)
    plan = moe.plan(experts)
    e, had = plan.expert_of_slot, exl3_triton.hadamard(DEVICE)
    with_shared = torch.cat([experts, torch.full((rows, 1), 3, device=DEVICE)], 1)  # the shared expert: 3
    assert torch.equal(e[plan.slot_of], with_shared.reshape(-1))  # slot_of inverts the sort

    def close(got, want, ulps):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert float((got.float() - want.float()).abs().max()) <= ulps * float(want.float().abs().max())

    close(layer_kernels._rows_in(x, plan, moe.gate.suh), exl3_triton.rotated_in(x[plan.row_of_slot], moe.gate.suh[e], had),
          2 ** -10)
    g, u = (torch.from_numpy(rng.standard_normal((splits, len(e), INTER)).astype(np.float32)).to(DEVICE) for _ in "gu")
    gate, up = (exl3_triton.rotated_out(p.sum(0), svh[e], had) for p, svh in ((g, moe.gate.svh), (u, moe.up.svh)))
    act = (gate.sigmoid() * gate).clamp(max=LIMIT) * up.clamp(-LIMIT, LIMIT)
    close(layer_kernels._activation(g, u, plan, moe.gate.svh, moe.up.svh, moe.down.suh, LIMIT),
          exl3_triton.rotated_in(act.half(), moe.down.suh[e], had), 2 ** -9)
    # down's sums past fp16's range (the split rotation scales each row into it)
    y = torch.from_numpy(rng.standard_normal((splits, len(e), H)).astype(np.float32) * 3e5).to(DEVICE)
    order = plan.slot_of.argsort()  # each slot's (row, choice)
    slot_weights = torch.cat([weights, torch.ones((rows, 1), device=DEVICE)], 1)  # the shared expert's: 1
    slots = exl3_triton.rotated_out(y.sum(0), moe.down.svh[e], had) * slot_weights.reshape(-1)[order][:, None]
    want = torch.empty_like(slots).index_copy_(0, order, slots)
    close(layer_kernels._combine(y, plan, weights, moe.down.svh, True), want.view(rows, k + 1, H).sum(1), 1e-5)


@pytest.mark.parametrize("rows,k,shared", [(1, 6, True), (16, 6, True), (80, 6, True), (80, 8, False)])
def test_the_plans_kernel_is_torchs_sort_exactly(rows, k, shared):
    """_plan_kernel (one launch) against _torch_plan (argsort, counts, scans, searches) at the
    Flash width's 256 experts: every field equal, on routings with a row repeating one expert
    (an expert-parallel slice's, a graph's padding row), one expert many rows chose (several
    work items) and the bound's padding items spanning several of the kernel's blocks."""
    gen = torch.Generator().manual_seed(rows + k)
    total = 256 + shared
    experts = torch.randint(0, 256, (rows, k), generator=gen)
    experts[:, 0] = 7  # every row: more than one work item of one expert
    experts[-1] = 3    # a row of one expert k times
    experts = experts.to(DEVICE)
    bound = exl3_triton.max_items(rows * (k + shared), total)
    got = layer_kernels._flat(layer_kernels._device_plan(experts, total, shared, bound))
    want = layer_kernels._flat(layer_kernels._torch_plan(experts, total, shared, bound))
    assert bound > layer_kernels.PLAN_BLOCK or rows == 1
    for name, a, b in zip(layer_kernels.PLAN_PARTS, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_plan_kernel_that_fails_leaves_torchs_sort_serving_and_says_why(monkeypatch, caplog):
    """The plan's kernel is checked against torch's at construction: one that fails (or differs)
    is refused with a warning and the reason kept, and the layer's sums are the same."""
    routed, shared, moe = layer(10, experts=3)
    rng = np.random.default_rng(10)
    x = torch.from_numpy(rng.standard_normal((5, H)).astype(np.float16)).to(DEVICE)
    weights = torch.from_numpy(rng.random((5, 2)).astype(np.float32)).to(DEVICE)
    chosen = torch.from_numpy(np.stack([rng.choice(3, 2, replace=False) for _ in range(5)])).to(DEVICE)
    assert moe.plan_refusal is None
    fast = moe(x, weights, chosen)

    def broken(experts, total, shared, bound):
        raise RuntimeError("no such instruction on this GPU")
    monkeypatch.setattr(layer_kernels, "_device_plan", broken)
    refused = TritonExl3Experts(routed, shared, LIMIT)
    assert refused.plan_refusal == "RuntimeError: no such instruction on this GPU"
    assert "plan each call with torch's sort" in caplog.text
    assert torch.equal(refused(x, weights, chosen), fast)

    def off_by_one(experts, total, shared, bound):  # a kernel that places one slot wrong
        plan = layer_kernels._torch_plan(experts, total, shared, bound)
        plan[2][-1] += 1
        return plan
    monkeypatch.setattr(layer_kernels, "_device_plan", off_by_one)
    assert TritonExl3Experts(routed, shared, LIMIT).plan_refusal == \
        "ValueError: its slot_of differs from torch's at 1 rows, 1 choices"


def test_padding_rows_weigh_nothing_and_every_call_gives_the_same_sums():
    _, _, moe = layer(2, shared=False)
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((4, H)).astype(np.float16)).to(DEVICE)
    chosen = torch.tensor([[0, 1], [1, 3], [0, 0], [0, 0]], device=DEVICE)  # the last two: a graph's padding
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.0, 0.0], [0.0, 0.0]], device=DEVICE)
    first = moe(x, weights, chosen)
    assert torch.equal(first, moe(x, weights, chosen))
    assert torch.equal(first[2:], torch.zeros_like(first[2:]))
    # without the padding: the same sums within rounding (fewer rows may split the input
    # otherwise, which orders the sums otherwise)
    alone = moe(x[:2], weights[:2], chosen[:2])
    assert torch.allclose(first[:2], alone, rtol=1e-5, atol=1e-6 * float(alone.abs().max()))


def test_what_the_kernel_does_not_decode_is_refused_by_name():
    rng = np.random.default_rng(4)
    six_bit = [(random_linear(rng, H, INTER, 6), random_linear(rng, H, INTER, 6), random_linear(rng, INTER, H, 6))]
    with pytest.raises(ValueError, match="6-bit trellis"):
        TritonExl3Experts(six_bit, None, LIMIT)
    unchained = [(random_linear(rng, H, INTER), random_linear(rng, H, INTER), random_linear(rng, H, INTER))]
    with pytest.raises(ValueError, match="do not chain"):
        TritonExl3Experts(unchained, None, LIMIT)
    narrow = [(random_linear(rng, H, 144), random_linear(rng, H, 144), random_linear(rng, 144, H))]
    with pytest.raises(ValueError, match="not multiples of 128"):
        TritonExl3Experts(narrow, None, LIMIT)
    assert "mul1" in refusal(unchained[0][:1], mul1=False)


def test_a_call_takes_the_configuration_tuned_at_the_fewest_rows_at_or_above_its_own():
    _, _, moe = layer(7, experts=2, shared=False)
    assert moe.config_at(3) == moe.kernel  # nothing tuned yet
    five, twenty = moe.CONFIGS[0], moe.CONFIGS[-1]
    moe.tuned = {5: five, 20: twenty}
    assert [moe.config_at(n) for n in (1, 5, 6, 20, 80)] == [five, five, twenty, twenty, twenty]
    assert moe.plan(torch.zeros((6, 2), dtype=torch.int64, device=DEVICE)).kernel == twenty
    assert all(set(c) == set(moe.kernel) for c in moe.CONFIGS)  # every configuration a plan can take


def test_tuning_keeps_the_fastest_configuration_and_leaves_out_those_that_fail(monkeypatch, caplog):
    """TritonExl3Experts.tune with the graph timing faked (CUDA graphs need a GPU; the GPU tier
    tunes for real): per row count the fastest configuration that ran, every configuration's
    time in CONFIGS' order, a failing one at inf; all failing raises; a new tuning starts afresh."""
    _, _, moe = layer(8, experts=2, shared=False)
    fastest = moe.CONFIGS[4]
    calls = []

    def fake_ms(fn, device):
        config = moe.config_at(calls[-1] if calls else 0)
        if config is moe.CONFIGS[0]:
            raise RuntimeError("out of resources")
        return 0.5 if config is fastest else 1.0 + moe.CONFIGS.index(config)
    monkeypatch.setattr(layer_kernels, "graph_ms", fake_ms)
    sample = (torch.zeros((5, H), dtype=torch.float16, device=DEVICE), torch.ones((5, 2), device=DEVICE),
              torch.zeros((5, 2), dtype=torch.int64, device=DEVICE))
    calls.append(5)
    result = moe.tune([sample])
    assert result[5]["config"] is fastest and result[5]["ms"] == 0.5 and moe.tuned == {5: fastest}
    assert result[5]["trials"][0] == float("inf") and len(result[5]["trials"]) == len(moe.CONFIGS)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"our expert kernel's configuration {moe.CONFIGS[0]} failed at 5 rows (left out): RuntimeError: out of resources"]
    assert result[5]["trials"][1:] == [0.5 if c is fastest else 1.0 + i + 1 for i, c in enumerate(moe.CONFIGS[1:])]

    def failing(fn, device):
        raise RuntimeError("no kernel for this GPU")
    monkeypatch.setattr(layer_kernels, "graph_ms", failing)
    with pytest.raises(RuntimeError, match="no kernel for this GPU"):
        moe.tune([sample])
    assert moe.tuned == {}  # the earlier tuning is gone, and no failing configuration is left


@pytest.mark.parametrize("kernel_ms,serves", [(1.0, True), (3.0, False)])
def test_tuning_times_the_plans_kernel_against_torchs_sort_and_keeps_the_faster(monkeypatch, kernel_ms, serves):
    """After the configurations, tune times the plan's kernel and torch's sort alone (the graph
    timing faked: it needs CUDA); the faster plans calls of that row count, and only there."""
    _, _, moe = layer(11, experts=2, shared=True)
    moe.CONFIGS = moe.CONFIGS[:1]  # the plans' timing is the subject: one configuration, not nine interpreted
    plans = {layer_kernels._device_plan: kernel_ms, layer_kernels._torch_plan: 2.0}

    def fake_ms(fn, device):
        fn()  # it runs
        bound = fn.__defaults__[0]  # a configuration's call binds its arguments, a plan's timing the plan
        return plans[bound] if bound in plans else 1.0
    monkeypatch.setattr(layer_kernels, "graph_ms", fake_ms)
    sample = (torch.zeros((5, H), dtype=torch.float16, device=DEVICE), torch.ones((5, 2), device=DEVICE),
              torch.zeros((5, 2), dtype=torch.int64, device=DEVICE))
    result = moe.tune([sample])
    assert result[5]["plan_ms"] == {"kernel": kernel_ms, "torch": 2.0} and moe.plan_kernel_at == {5: serves}
    assert [moe.plan_kernel_serves(n) for n in (1, 5, 80)] == [serves] * 3


def test_the_input_is_split_until_the_programs_fill_the_gpu_or_a_split_is_eight_tiles():
    _, _, moe = layer(9, experts=2, shared=False)
    moe.sms = 1  # one multiprocessor, as on a CPU
    experts = torch.zeros((3, 2), dtype=torch.int64, device=DEVICE)
    splits = {}
    for fill in (1, 8, 1 << 20):
        moe.kernel = {**moe.kernel, "fill": fill}
        config = moe.plan(experts).config(H, INTER)
        assert set(config) == {"nt", "num_warps", "splits"} and INTER // 16 % config["nt"] == 0
        splits[fill] = config["splits"]
    assert splits[1] == 1  # one multiprocessor's worth of programs is there without a split
    assert splits[1] <= splits[8] <= splits[1 << 20] == H // 16 // 8  # then at most down to 8 input tiles


def test_the_layer_benchmark_sets_runs_before_and_after_a_change_side_by_side(tmp_path):
    """benchmarks/exl3_moe_layer.py --compare (gpu.sh ONLY_DRAFTER_ROUND=moe-before-after feeds
    it two runs a side, alternated in one call): per row count each side's mean layer and
    products time, after over before, the products' trellis rate and each side's spread; the
    same tree on both sides refused."""
    def run(path, code, layer_ms, products_ms):
        rows = [{"rows": r, "ours_ms": ms, "ours_products_ms": p, "trellis_bytes": 10**9, "ours_config": {"nt": 16}}
                for r, ms, p in zip((5, 80), layer_ms, products_ms)]
        path.write_text(json.dumps({"device": "H100", "remote_drafter": code, "rows": rows}))
        return str(path)
    befores = [run(tmp_path / f"b{i}.json", "/before", (0.24, 1.1), (0.2, 1.0)) for i in (1, 2)]
    afters = [run(tmp_path / "a1.json", "/after", (0.21, 0.9), (0.17, 0.8)),
              run(tmp_path / "a2.json", "/after", (0.23, 0.9), (0.19, 0.8))]
    out = tmp_path / "c.json"
    script = benchmark_scripts.load("exl3_moe_layer")
    assert script.main(["--compare", ",".join(befores), ",".join(afters), "--out", str(out)]) == 0
    five, eighty = json.loads(out.read_text())["rows"]
    assert five["layer_ms"] == [0.24, 0.22] and five["layer_ms_after_over_before"] == 0.917
    assert five["layer_ms_spread"] == [1.0, round(0.23 / 0.21, 3)]
    assert eighty["products_ms_after_over_before"] == 0.8 and eighty["products_tb_s"] == [1.0, 1.25]
    with pytest.raises(SystemExit, match="same code"):
        script.main(["--compare", ",".join(befores), ",".join(befores), "--out", str(out)])
