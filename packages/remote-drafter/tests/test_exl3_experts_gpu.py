"""GPU tier (CUDA and exllamav3; CI has neither and skips it: `benchmarks/gpu.sh` with
ONLY_DRAFTER_ROUND=tests runs it on an H200 with the [exl3] extra's wheels carried): DeepSeek's
drafter's EXL3 experts through exllamav3's fused kernels against the per-matrix path, on the
same tiny pack, at row counts that take each tier; and the dense copies of the other EXL3
linears (models/exl3_dense.py) against their kernels."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.models import exl3  # noqa: E402

WHY = exl3.refusal("cuda:0")
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"GPU tier ({WHY}): benchmarks/gpu.sh "
                                "with ONLY_DRAFTER_ROUND=tests runs it on an H200")

from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.dsv41 import exl3_pack, tiny  # noqa: E402
from remote_drafter.models.dsv41.drafter import ENCODE_BUCKETS, Dsv41Drafter  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402
from remote_drafter.models.exl3_experts import COOP_SLOTS  # noqa: E402
from remote_drafter.testing import draft_agreement  # noqa: E402

DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    folder, out = tmp_path_factory.mktemp("tiny"), tmp_path_factory.mktemp("pack")
    tiny.write_tiny(str(folder))
    Dsv41Drafter.convert_exl3(str(folder), str(out), 4, None, DEVICE)
    return str(out)


def two_models(pack: str) -> tuple[Dsv41Model, Dsv41Model]:
    """(per matrix, fused) on the same EXL3 linears."""
    loaded = exl3_pack.load(pack, torch.bfloat16, DEVICE)
    per_matrix, fused = (Dsv41Model(loaded.config, loaded.weights, DEVICE, linears=loaded.linears)
                         for _ in range(2))
    assert fused.fuse_exl3_experts() is None
    return per_matrix, fused


def test_fused_experts_give_the_per_matrix_sum_in_every_tier(pack):
    per_matrix, fused = two_models(pack)
    c = fused.config
    coop_rows = COOP_SLOTS // c.num_experts_per_tok
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    # one row; a block; the coop tier's last row count; the sorted tier; the shared expert in chunks
    for rows in (1, c.block_size, coop_rows, coop_rows + 1, 2 * COOP_SLOTS + 3):
        for j in range(c.n_mtp_layers):
            x = torch.randn(rows, c.hidden_size, generator=gen, device=DEVICE).to(torch.bfloat16)
            want, got = per_matrix.layers[j].moe(x), fused.layers[j].moe(x)
            assert got.shape == want.shape and got.dtype == want.dtype
            error = float((got.float() - want.float()).norm() / want.float().norm())
            assert error < 1e-2, f"{rows} rows, layer {j}: relative error {error:.2e}"
    # the coop tier's result is copied out: a second layer's call leaves the first's intact
    x = torch.randn(3, c.hidden_size, generator=gen, device=DEVICE).to(torch.bfloat16)
    first = fused.layers[0].moe(x)
    kept = first.clone()
    fused.layers[1].moe(x)
    assert torch.equal(first, kept)


def test_fused_rounds_in_graphs_draft_as_per_matrix_eager_rounds(pack):
    per_matrix, fused = two_models(pack)
    manifest = Dsv41Drafter.load(pack, device=DEVICE, dtype=torch.bfloat16).manifest()
    eager = Dsv41Drafter(per_matrix, manifest, DEVICE, cuda_graphs=None, fuse_experts=False)
    graphed = Dsv41Drafter(fused, manifest, DEVICE, cuda_graphs=None)  # auto: fused, so captured
    assert graphed.describe()["experts"].startswith("exl3 fused (") and \
        graphed.describe()["cuda_graphs"] != "off (eager rounds)"
    assert eager.describe()["experts"].startswith("exl3 per matrix") and \
        eager.describe()["cuda_graphs"] == "off (eager rounds)"
    # 20: above every bucket, eager with the fused experts
    eager_drafts, graphed_drafts = same_rounds(eager, graphed, (1, 4, 16, 20), seed=0)
    assert_near_ties_only(draft_agreement(eager_drafts, graphed_drafts), "fused + graphs vs per matrix eager")


def test_our_kernel_gives_the_per_matrix_sum_at_every_row_count(pack):
    per_matrix, fused = two_models(pack)
    c = fused.config
    assert fused.choose_expert_kernels([1], "ours") == ("exl3 fused (ours at [1] rows, exllamav3's at no rows)", None)
    for layer in fused.layers:
        assert layer.moe.experts.ours is not None, layer.moe.experts.ours_refusal
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    # one row; a block; an expert's slots over two work items; above every bucket
    for rows in (1, c.block_size, 17, 2 * COOP_SLOTS + 3):
        for j in range(c.n_mtp_layers):
            x = torch.randn(rows, c.hidden_size, generator=gen, device=DEVICE).to(torch.bfloat16)
            want, got = per_matrix.layers[j].moe(x), fused.layers[j].moe(x)
            error = float((got.float() - want.float()).norm() / want.float().norm())
            assert error < 1e-2, f"{rows} rows, layer {j}: relative error {error:.2e}"
    fused.choose_expert_kernels([5, 10], "auto")  # timed: one or the other serves each count, the same in every layer
    chosen = fused.layers[0].moe.experts.ours_at
    assert set(chosen) == {5, 10} and all(layer.moe.experts.ours_at == chosen for layer in fused.layers)


def test_rounds_on_our_kernel_in_graphs_draft_as_per_matrix_eager_rounds(pack, monkeypatch):
    monkeypatch.setenv("REMOTE_DRAFTER_EXL3_EXPERTS", "ours")
    per_matrix, fused = two_models(pack)
    manifest = Dsv41Drafter.load(pack, device=DEVICE, dtype=torch.bfloat16).manifest()
    eager = Dsv41Drafter(per_matrix, manifest, DEVICE, cuda_graphs=None, fuse_experts=False)
    graphed = Dsv41Drafter(fused, manifest, DEVICE, cuda_graphs=None)
    assert "exllamav3's at no rows" in graphed.describe()["experts"]
    eager_drafts, graphed_drafts = same_rounds(eager, graphed, (1, 4, 16, 20), seed=1)
    assert_near_ties_only(draft_agreement(eager_drafts, graphed_drafts), "ours + graphs vs per matrix eager")


def same_rounds(a: Dsv41Drafter, b: Dsv41Drafter, batches, seed: int) -> tuple[list, list]:
    """Both drafters' drafts (with probabilities) of the same random rounds, one per batch size."""
    rng = np.random.default_rng(seed)
    drafts_a, drafts_b = [], []
    for batch in batches:
        requests = []
        for _ in range(batch):
            h = a.new_history()
            n = int(rng.integers(2, 160))
            h.reset(rng.integers(0, a.vocab_size, n).astype(np.int32),
                    rng.standard_normal((n - 1, a.feature)).astype(np.float32))
            requests.append(DraftRequest(h, a.max_depth))
        drafts_a += a.draft(requests, True)
        drafts_b += b.draft(requests, True)
    return drafts_a, drafts_b


def assert_near_ties_only(agreement: dict, what: str) -> None:
    """Most drafts identical, and where two part, the first drafter's top two were nearly tied."""
    gaps = agreement["top_two_gaps_where_they_part"]
    print(f"{what}: {agreement['same_greedy_drafts']}/{agreement['requests']} drafts identical; "
          f"top-2 gaps where they part: {gaps}")
    assert all(g < 0.05 for g in gaps), f"drafts part away from near-ties: top-2 gaps {gaps}"
    assert agreement["same_greedy_drafts"] >= 0.8 * agreement["requests"]


def test_new_rows_encoded_in_graphs_equal_their_eager_encoding(pack):
    """A round's new rows go through the captured encoding, padded to a bucket: each row's
    context rows as the eager encoding gives them, alone; above every bucket, eager."""
    _, fused = two_models(pack)
    manifest = Dsv41Drafter.load(pack, device=DEVICE, dtype=torch.bfloat16).manifest()
    d = Dsv41Drafter(fused, manifest, DEVICE, cuda_graphs=None)
    assert d.describe()["encode_graphs"] == ENCODE_BUCKETS
    rng = np.random.default_rng(1)
    for n in (1, 3, 16, 50, ENCODE_BUCKETS[-1], ENCODE_BUCKETS[-1] + 1):
        rows = rng.standard_normal((n, d.feature)).astype(np.float32)
        positions = rng.integers(0, 4096, n)
        rows, positions = torch.from_numpy(rows).to(DEVICE), torch.from_numpy(positions).to(DEVICE)
        got = d._encode(rows, positions).float()
        want = fused.encode_rows(rows, positions).float()
        err = float((got - want).norm() / want.norm())
        assert got.shape == want.shape and err < 1e-2, (n, err)


def test_incremental_rounds_in_graphs_draft_as_eager_rounds(pack):
    """Rounds as a worker serves them: each request's history grows by 1-4 rows a round, so
    every round encodes a few new rows (in the encoding graphs) into the device windows."""
    _, fused = two_models(pack)
    manifest = Dsv41Drafter.load(pack, device=DEVICE, dtype=torch.bfloat16).manifest()
    eager = Dsv41Drafter(fused, manifest, DEVICE, cuda_graphs=False)
    graphed = Dsv41Drafter(fused, manifest, DEVICE, cuda_graphs=None)
    rng = np.random.default_rng(2)
    histories = []
    for _ in range(4):
        h = graphed.new_history()
        n = int(rng.integers(2, 60))
        h.reset(rng.integers(0, graphed.vocab_size, n).astype(np.int32),
                rng.standard_normal((n - 1, graphed.feature)).astype(np.float32))
        histories.append(h)
    eager_drafts, graphed_drafts = [], []
    for _ in range(12):
        for h in histories:
            k = int(rng.integers(1, 5))
            h.extend(rng.integers(0, graphed.vocab_size, k).astype(np.int32),
                     rng.standard_normal((k, graphed.feature)).astype(np.float32))
        requests = [DraftRequest(copy.copy(h), graphed.max_depth) for h in histories]
        eager_drafts += eager.draft(requests, False)
        graphed_drafts += graphed.draft(requests, False)
    assert_near_ties_only(draft_agreement(eager_drafts, graphed_drafts), "incremental rounds, graphs vs eager")


def test_two_slices_of_a_pack_each_read_their_experts_and_sum_to_the_whole(pack):
    """An expert-parallel pair's halves of a pack (drafter_tp2's dsv41 kind): each load reads
    only its routed experts; each half's MoE layers, fused (the shared expert in the first
    half's launches only), sum to the whole pack's, in every tier."""
    from remote_drafter.models.dsv41.config import routed_expert
    whole = exl3_pack.load(pack, torch.bfloat16, DEVICE)
    one = Dsv41Model(whole.config, whole.weights, DEVICE, linears=whole.linears)
    assert one.fuse_exl3_experts() is None
    c = whole.config
    halves = (range(0, c.n_routed_experts // 2), range(c.n_routed_experts // 2, c.n_routed_experts))
    ranks = []
    for r, held in enumerate(halves):
        part = exl3_pack.load(pack, torch.bfloat16, DEVICE, experts=held)
        assert {routed_expert(n) for n in part.tensor_digests} - {None} == set(held)
        model = Dsv41Model(part.config, part.weights, DEVICE, linears=part.linears, experts=held)
        for layer in model.layers:
            layer.moe.adds_shared = r == 0
        assert model.fuse_exl3_experts() is None and model.experts_fused
        ranks.append(model)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    coop_rows = COOP_SLOTS // c.num_experts_per_tok
    for rows in (1, c.block_size, coop_rows + 1):
        for j in range(c.n_mtp_layers):
            x = torch.randn(rows, c.hidden_size, generator=gen, device=DEVICE).to(torch.bfloat16)
            want = one.layers[j].moe(x).float()
            got = ranks[0].layers[j].moe(x).float() + ranks[1].layers[j].moe(x).float()
            error = float((got - want).norm() / want.norm())
            assert error < 1e-2, f"{rows} rows, layer {j}: relative error {error:.2e}"


def fused_model(pack: str) -> Dsv41Model:
    """A model of its own EXL3 linears (dense copies are held per linear), experts fused."""
    loaded = exl3_pack.load(pack, torch.bfloat16, DEVICE)
    model = Dsv41Model(loaded.config, loaded.weights, DEVICE, linears=loaded.linears)
    assert model.fuse_exl3_experts() is None
    return model


def test_a_dense_copy_gives_the_kernels_product_from_its_row_count_up(pack):
    """Every EXL3 linear outside the routed experts (wo_a's groups as one, each fused layer's
    shared expert as one): exllamav3's reconstruction in dense GEMMs gives the kernels'
    product, and keep_dense(R) takes it from R rows up."""
    model = fused_model(pack)
    outside = {n: m for n, (m, _) in model.dense_candidates([5], [4]).items()}
    assert any(isinstance(m, exl3.Exl3Groups) for m in outside.values())
    assert sum(n.endswith(".ffn.shared_experts") for n in outside) == len(model.layers)
    for name, linear in outside.items():
        dense = linear.dense()
        assert sum(w.numel() * 2 for w in (dense if isinstance(dense, tuple) else [dense])) == linear.dense_bytes
        for rows in (1, 5, 80, COOP_SLOTS + 3):
            x = linear.probe(rows)
            want, got = linear.run(x, None).float().clone(), linear.run(x, dense).float()
            err = float((got - want).norm() / want.norm())
            assert got.shape == want.shape and err < 1e-2, (name, rows, err)
        took, run = [], linear.run
        linear.run = lambda x, weight, run=run, took=took: took.append(weight is not None) or run(x, weight)
        linear.keep_dense(5)
        for rows in (1, 4, 5, 80):
            linear(linear.probe(rows))
        assert took == [False, False, True, True], name


def test_dense_copies_chosen_at_start_up_fit_their_budget_stay_and_draft_as_the_kernels(pack):
    manifest = Dsv41Drafter.load(pack, device=DEVICE, dtype=torch.bfloat16).manifest()
    chosen_model = fused_model(pack)
    budget_mib = 1
    d = Dsv41Drafter(chosen_model, manifest, DEVICE, cuda_graphs=None, dense_mib=budget_mib)
    status = d.describe()["exl3_dense"]
    print(f"tiny pack, dense copies chosen within {budget_mib} MiB: {status}")
    assert status["bytes"] <= budget_mib << 20
    candidates = chosen_model.dense_candidates([5], [4])
    for name, from_rows in status["from_rows"].items():
        linear = candidates[name][0]
        assert linear.dense_weight is not None and linear.dense_from == from_rows
    again = Dsv41Drafter(chosen_model, manifest, DEVICE, cuda_graphs=None, dense_mib=0)
    assert again.describe()["exl3_dense"] == status  # kept: the first drafter's graphs read them
    # every copy forced from one row up, in graphs, against the kernels alone
    kernels, dense = fused_model(pack), fused_model(pack)
    for linear, _ in dense.dense_candidates([5], [4]).values():  # the shared experts too
        linear.keep_dense(1)
    by_kernels = Dsv41Drafter(kernels, manifest, DEVICE, cuda_graphs=None, dense_mib=0)
    by_dense = Dsv41Drafter(dense, manifest, DEVICE, cuda_graphs=None, dense_mib=0)
    assert by_kernels.describe()["exl3_dense"] == {"bytes": 0, "from_rows": {}}
    a, b = same_rounds(by_kernels, by_dense, (1, 4, 16), seed=5)
    assert_near_ties_only(draft_agreement(a, b), "dense copies vs exllamav3's kernels, graphs")
