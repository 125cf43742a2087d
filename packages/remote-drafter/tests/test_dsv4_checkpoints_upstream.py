"""Checkpoints that upstream loads, we load: a DeepSeek-V4 config without `n_mtp_layers`
(its stages counted as exllamav3 counts them, by compress_ratios' entries past the trunk) and a
confidence head stored bf16 (vLLM upcasts it into its float32 parameter). Each loads and
drafts exactly as the equivalent folder that states the count / stores the head in float32.
And the config classes: one per variant, picked by model_type."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from safetensors.torch import load_file, save_file  # noqa: E402

from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint  # noqa: E402
from remote_drafter.models.dsv41.config import (  # noqa: E402
    DEFAULT_STAGES,
    Dsv41DrafterConfig,
    V4DrafterConfig,
    V41DrafterConfig,
)
from remote_drafter.models.dsv41.drafter import Dsv41Drafter  # noqa: E402
from remote_drafter.models.dsv41.tiny import tiny_config, write_tiny  # noqa: E402

STAGES = 2  # not vLLM's default (3): a count read from the wrong place is refused


def edit_config(folder, edit):
    path = os.path.join(folder, checkpoint.CONFIG_FILE)
    with open(path) as f:
        config = json.load(f)
    edit(config.get("text_config", config))
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def retype(folder, name, dtype):
    """Store tensor `name` as `dtype` (same name, same shard: the index stays right)."""
    shard = checkpoint.tensor_files(folder)[name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, shard, metadata={"format": "pt"})


def drafts(folder):
    """Greedy and sampled drafts of a few histories, with their confidences."""
    d = Dsv41Drafter.load(folder, confidence_cutoff=0.0)
    rng = np.random.default_rng(5)
    requests = []
    for n, temperature in ((3, 0.0), (d.window + 9, 0.0), (40, 0.9)):
        h = d.new_history()
        h.reset(rng.integers(0, d.vocab_size - 1, n).astype(np.int32),
                rng.standard_normal((n - 1, d.feature)).astype(np.float32))
        requests.append(DraftRequest(h, d.max_depth, temperature, 7))
    return d, d.draft(requests, False)


def assert_same_drafts(a, b):
    """The same tokens; probabilities and confidences to float32 rounding (the same weights
    at other addresses may round a BLAS dot product's last bit otherwise)."""
    for x, y in zip(a, b):
        assert np.array_equal(x.tokens, y.tokens)
        assert np.allclose(x.own_probs, y.own_probs, rtol=1e-6, atol=0)
        assert x.confidence is not None and np.allclose(x.confidence, y.confidence, rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def v4_folder(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dsv4") / "stated")
    write_tiny(out, seed=2, n_mtp_layers=STAGES, variant="v4")
    return out


def test_a_v4_config_without_n_mtp_layers_counts_stages_past_the_trunk(v4_folder, tmp_path):
    counted = shutil.copytree(v4_folder, tmp_path / "counted")
    edit_config(counted, lambda c: c.pop("n_mtp_layers"))
    config = checkpoint.read_config(counted)
    assert len(config["compress_ratios"]) - config["num_hidden_layers"] == STAGES
    stated, loaded = checkpoint.load(v4_folder), checkpoint.load(counted)
    assert loaded.config.n_mtp_layers == STAGES and not checkpoint.describe(counted)["problems"]
    assert loaded.config == stated.config  # so the digests, which cover the config, agree
    assert (loaded.drafter_digest, loaded.markov_digest) == (stated.drafter_digest, stated.markov_digest)
    d_stated, by_stated = drafts(v4_folder)
    d_counted, by_counted = drafts(str(counted))
    assert d_counted.manifest() == d_stated.manifest()
    assert_same_drafts(by_counted, by_stated)


def test_how_a_v4_config_counts_its_stages():
    config = tiny_config(STAGES, variant="v4")
    layers = config["num_hidden_layers"]
    without = {k: v for k, v in config.items() if k != "n_mtp_layers"}
    assert Dsv41DrafterConfig.from_json(without).n_mtp_layers == STAGES
    # n_mtp_layers, where given, is what vLLM reads: it wins over the tail
    assert Dsv41DrafterConfig.from_json({**config, "n_mtp_layers": 1}).n_mtp_layers == 1
    # no tail past the trunk (or no compress_ratios): vLLM's default
    for ratios in ([0] * layers, None):
        assert Dsv41DrafterConfig.from_json({**without, "compress_ratios": ratios}).n_mtp_layers \
            == DEFAULT_STAGES
    # V4's num_nextn_predict_layers (1 beside three stages in V4-Flash) is not a count
    assert Dsv41DrafterConfig.from_json({**without, "num_nextn_predict_layers": 1}).n_mtp_layers == STAGES


@pytest.mark.parametrize("variant", ["v41", "v4"])
def test_a_bf16_confidence_head_loads_upcast_and_drafts_as_the_float32_one(tmp_path, variant):
    f32 = str(tmp_path / "f32")
    write_tiny(f32, seed=3, n_mtp_layers=STAGES, variant=variant)
    head = f"mtp.{STAGES - 1}.confidence_head.proj.weight"
    # the float32 folder holds values bf16 holds exactly, so the upcast gives the same weights
    stored = load_file(checkpoint.tensor_files(f32)[head])[head]
    assert stored.dtype == torch.float32 and not torch.equal(stored, stored.bfloat16().float())
    retype(f32, head, torch.bfloat16)
    retype(f32, head, torch.float32)
    bf16 = shutil.copytree(f32, tmp_path / "bf16")
    retype(bf16, head, torch.bfloat16)
    described = checkpoint.describe(bf16)
    assert described["tensors"][head]["dtype"] == "BF16" and not described["problems"]
    wide, narrow = checkpoint.load(f32), checkpoint.load(bf16)
    assert narrow.config.enable_confidence_head and narrow.weights[head].dtype == torch.float32
    assert narrow.weights.keys() == wide.weights.keys()
    assert all(torch.equal(narrow.weights[n], wide.weights[n]) for n in wide.weights)
    d_f32, by_f32 = drafts(f32)
    d_bf16, by_bf16 = drafts(str(bf16))
    assert d_bf16.model.confidence is not None
    assert_same_drafts(by_bf16, by_f32)
    # the upcast is the confidence head's alone: a bf16 attention sink is still refused
    retype(bf16, "mtp.0.attn.attn_sink", torch.bfloat16)
    with pytest.raises(ValueError, match="mtp.0.attn.attn_sink: stored as BF16, expected f32"):
        checkpoint.load(bf16)


def test_each_variant_is_its_own_config_class():
    v41 = Dsv41DrafterConfig.from_json(tiny_config(variant="v41"))
    v4 = Dsv41DrafterConfig.from_json(tiny_config(variant="v4"))
    assert type(v41) is V41DrafterConfig and type(v4) is V4DrafterConfig
    assert (v41.variant, v41.name, v4.variant, v4.name) == ("v41", "DeepSeek-V4.1", "v4", "DeepSeek-V4")
    assert [f.name for f in dataclasses.fields(v41)] == [f.name for f in dataclasses.fields(v4)]
    assert type(dataclasses.replace(v4, block_size=3)) is V4DrafterConfig
    assert V4DrafterConfig.from_json(tiny_config(variant="v4")) == v4
    with pytest.raises(ValueError, match="model_type 'deepseek_v41'"):
        V4DrafterConfig.from_json(tiny_config(variant="v41"))
    # the forward's switches are the class's: the variant field cannot disagree with them
    with pytest.raises(TypeError, match="V41DrafterConfig with variant 'v4'"):
        dataclasses.replace(v41, variant="v4")
    with pytest.raises(TypeError, match="from_json picks"):
        Dsv41DrafterConfig(**{f.name: getattr(v41, f.name) for f in dataclasses.fields(v41)})
