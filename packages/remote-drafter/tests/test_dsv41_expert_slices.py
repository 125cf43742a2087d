"""An expert-parallel rank's slice of DeepSeek's drafter (what drafter_tp2 splits over two
cards): the loader reads only the slice's routed experts (the others may be missing), the
slices' tensor digests combine into the whole checkpoint's, and the slices' MoE layers,
each adding its own chosen experts (the shared expert on one of them), sum to one card's."""

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from safetensors.torch import load_file, save_file  # noqa: E402

from remote_drafter.models.dsv41 import checkpoint, tiny  # noqa: E402
from remote_drafter.models.dsv41.config import routed_expert  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402
from remote_drafter.models.dsv41.modules.attention import unseen_keys  # noqa: E402

SLICES = (range(0, 2), range(2, 4))  # the tiny drafter's 4 routed experts, two ranks


@pytest.fixture(scope="module", params=tiny.VARIANT_NAMES)
def folder(tmp_path_factory, request):
    out = str(tmp_path_factory.mktemp(request.param))
    tiny.write_tiny(out, variant=request.param)
    return out


def drop_tensors(folder: str, keep) -> None:
    """Rewrite every shard without the tensors keep(name) refuses, the index in step."""
    index_path = os.path.join(folder, checkpoint.INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    for shard in sorted(set(index["weight_map"].values())):
        path = os.path.join(folder, shard)
        save_file({n: t for n, t in load_file(path).items() if keep(n)}, path, metadata={"format": "pt"})
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if keep(n)}
    with open(index_path, "w") as f:
        json.dump(index, f)


def test_a_slice_reads_only_its_experts_and_the_digests_combine(folder):
    whole = checkpoint.load(folder, torch.float32)
    parts = [checkpoint.load(folder, torch.float32, experts=held) for held in SLICES]
    for held, part in zip(SLICES, parts):
        read = {routed_expert(n) for n in part.tensor_digests} - {None}
        assert read == set(held) and part.experts == held
        assert {routed_expert(n) for n in part.weights} - {None} == set(held)
    combined = {**parts[0].tensor_digests, **parts[1].tensor_digests}
    assert combined == whole.tensor_digests
    assert checkpoint.digests(whole.config, combined) == (whole.drafter_digest, whole.markov_digest)
    assert parts[0].drafter_digest != whole.drafter_digest  # a slice's own digest is the slice's


def test_a_slice_loads_without_the_other_ranks_experts_and_names_its_own_missing(folder, tmp_path):
    import shutil
    mine = shutil.copytree(folder, tmp_path / "rank0")
    drop_tensors(str(mine), lambda n: routed_expert(n) not in SLICES[1])
    assert checkpoint.load(str(mine), torch.float32, experts=SLICES[0]).weights
    with pytest.raises(ValueError, match=r"mtp\.0\.ffn\.experts\.2\.w1\.weight: missing"):
        checkpoint.load(str(mine), torch.float32, experts=SLICES[1])
    with pytest.raises(ValueError, match="missing"):
        checkpoint.load(str(mine), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_slices_moe_layers_sum_to_one_cards(folder, dtype):
    """Each layer's MoE on the two slices (the shared expert added by the first only),
    summed, against the whole model's: float64 to rounding, float32 within its rounding;
    the whole block likewise, the sums added inside the layers (what drafter_tp2's
    all-reduce gives both ranks)."""
    whole = checkpoint.load(folder, torch.float32)
    one = Dsv41Model(whole.config, whole.weights, dtype=dtype)
    ranks = [Dsv41Model(whole.config, checkpoint.load(folder, torch.float32, experts=held).weights,
                        dtype=dtype, experts=held) for held in SLICES]
    for layer in ranks[1].layers:
        layer.moe.adds_shared = False
    c = whole.config
    x = torch.randn(7, c.hidden_size, generator=torch.Generator().manual_seed(3), dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for j, layer in enumerate(one.layers):
        want = layer.moe(x)
        got = ranks[0].layers[j].moe(x) + ranks[1].layers[j].moe(x)
        assert float((got - want).abs().max() / want.abs().max()) < tol, f"layer {j}"
    # the whole block, each MoE's partial sums added across the ranks inside the layers
    gen = torch.Generator().manual_seed(4)
    ctx = torch.randn(2, 16, c.n_mtp_layers, c.head_dim, generator=gen, dtype=dtype)
    inputs = (ctx, torch.ones(2, 16, dtype=torch.bool), torch.tensor([3, 5]), torch.tensor([20, 40]))
    want = one.block_hidden(*inputs)
    got = _interleaved(ranks, inputs)
    assert float((got - want).abs().max() / want.abs().max()) < 10 * tol


def _interleaved(ranks, inputs):
    """Both ranks' block, layer by layer, each MoE's partial sums added across the ranks
    (what an all-reduce gives both ranks)."""
    c = ranks[0].config
    ctx, valid, seed, p0 = inputs
    states = []
    for model in ranks:
        x, _ = model.embedding(seed)
        positions = p0[:, None] + torch.arange(c.block_size)
        states.append([x[..., None, :].expand(*x.shape[:-1], c.hc_mult, x.shape[-1]), None, positions])
    for j in range(c.n_mtp_layers):
        halves = []
        for r, model in enumerate(ranks):
            residual, pre, positions = states[r]
            layer = model.layers[j]
            x, post, comb, attn_pre = layer.attn_mix.pre(residual, pre)
            residual = layer.attn_mix.post(layer.attention(x, positions, ctx[:, :, j], unseen_keys(valid, c.block_size)),
                                           residual, post, comb)
            x, post, comb, ffn_pre = layer.ffn_mix.pre(residual, attn_pre)
            halves.append((layer.moe(x), residual, post, comb, ffn_pre))
        total = halves[0][0] + halves[1][0]
        for r, model in enumerate(ranks):
            _, residual, post, comb, ffn_pre = halves[r]
            states[r] = [model.layers[j].ffn_mix.post(total, residual, post, comb), ffn_pre, states[r][2]]
    residual, pre, _ = states[0]
    model = ranks[0]
    if model.output_collapse is not None:
        pre = model.output_collapse(residual)
    return model.numerics.collapse(residual, pre)
