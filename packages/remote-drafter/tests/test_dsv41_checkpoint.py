"""DeepSeek-V4.1's drafter checkpoint: FP8 / FP4 dequantisation against values worked out by
hand, quantise -> dequantise within each format's error, the loader's refusals (each naming
its tensor), trunk tensors never read, digests that follow the drafter's tensors only, and
tiny-dsv41 -> inspect through the CLI."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from remote_drafter.cli import main  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint, quant  # noqa: E402
from remote_drafter.models.dsv41.checkpoint import INDEX_FILE  # noqa: E402
from remote_drafter.models.dsv41.tiny import write_tiny  # noqa: E402

SHARD2 = "model-00002-of-00002.safetensors"


def e8m0(*codes):
    return torch.tensor(codes, dtype=torch.uint8).view(quant.E8M0)


# -- FP8 ---------------------------------------------------------------------------------

def test_fp8_bytes_times_ue8m0_block_scales():
    # E4M3 bytes: 0x38 = 1.0, 0x3C = 1.5, 0x40 = 2.0, 0xB8 = -1.0, 0x01 = 2^-9 (the
    # smallest subnormal), 0x7E = 448 (the largest); UE8M0: 125 = 1/4, 128 = 2, 130 = 8, 127 = 1
    weight = torch.tensor([[0x38, 0x3C, 0x40],
                           [0xB8, 0x01, 0x7E],
                           [0x40, 0x38, 0xB8]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = e8m0(125, 128, 130, 127).view(2, 2)  # 2 x 2 blocks over 3 x 3: partial edges
    got = quant.dequantize_fp8(weight, scale, torch.float32, block=(2, 2))
    want = torch.tensor([[0.25, 0.375, 4.0],
                         [-0.25, 2.0 ** -11, 896.0],
                         [16.0, 8.0, -1.0]])
    assert torch.equal(got, want)
    # float32 scales (FP8-expert checkpoints) multiply the same way
    assert torch.equal(quant.dequantize_fp8(weight, quant.e8m0_to_float32(scale), torch.float32,
                                            block=(2, 2)), want)
    # uint8 exponent bytes (a torch without float8_e8m0fnu) read the same
    assert torch.equal(quant.dequantize_fp8(weight, scale.view(torch.uint8), torch.float32,
                                            block=(2, 2)), want)


def test_fp8_default_blocks_are_128_by_128():
    weight = torch.full((256, 200), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # all 1.0
    got = quant.dequantize_fp8(weight, e8m0(126, 127, 128, 129).view(2, 2), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert got[:128, :128].eq(0.5).all() and got[:128, 128:].eq(1).all()
    assert got[128:, :128].eq(2).all() and got[128:, 128:].eq(4).all()
    with pytest.raises(ValueError, match=r"scale shape \(2, 1\), expected \(2, 2\)"):
        quant.dequantize_fp8(weight, e8m0(127, 127).view(2, 1), torch.float32)


@pytest.mark.parametrize("ue8m0", [True, False])
def test_fp8_round_trip_within_e4m3_error(ue8m0):
    x = torch.randn(300, 260, generator=torch.Generator().manual_seed(1)) * 0.03
    weight, scale = quant.quantize_fp8(x, ue8m0=ue8m0)
    assert weight.dtype == torch.float8_e4m3fn and scale.shape == (3, 3)
    if ue8m0:
        assert scale.dtype == quant.E8M0
        assert quant.e8m0_to_float32(scale).log2().frac().eq(0).all()  # powers of two
    back = quant.dequantize_fp8(weight, scale, torch.float32)
    # 3 mantissa bits: half an ulp is 2^-4 of the value, or half the subnormal step
    factor = quant.scale_as_float32(scale).repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = torch.maximum(x.abs() / 16, factor[:300, :260] * 2.0 ** -10)
    assert ((back - x).abs() <= bound).all()


# -- FP4 ---------------------------------------------------------------------------------

def test_fp4_nibbles_low_first_and_group_scales():
    # E2M1 codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign; element 2i is the low
    # nibble: 0x21 -> (0.5, 1.0), 0xF9 -> (-0.5, -6), 0x7F -> (-6, 6), 0x80 -> (0, -0)
    assert quant.unpack_fp4(torch.tensor([[0x21, 0xF9, 0x7F, 0x80]], dtype=torch.uint8)).tolist() \
        == [[0.5, 1.0, -0.5, -6.0, -6.0, 6.0, 0.0, -0.0]]
    # one row of 64 values = two groups of 32: scale 2 (code 128), then 1/2 (code 126)
    packed = torch.tensor([[0x21] * 16 + [0x7F] * 16], dtype=torch.int8)  # int8 as DeepSeek stores
    got = quant.dequantize_fp4(packed, e8m0(128, 126).view(1, 2), torch.float32)
    assert got[0, :32].tolist() == [1.0, 2.0] * 16
    assert got[0, 32:].tolist() == [-3.0, 3.0] * 16
    if hasattr(torch, "float4_e2m1fn_x2"):  # safetensors' F4 storage reads the same
        assert torch.equal(quant.dequantize_fp4(packed.view(torch.float4_e2m1fn_x2),
                                                e8m0(128, 126).view(1, 2), torch.float32), got)
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequantize_fp4(packed, e8m0(128).view(1, 1), torch.float32)


def test_fp4_quantise_packs_what_it_reads():
    x = torch.tensor([[0.5, 1.0, -0.5, -6.0] + [0.0] * 28])
    packed, scale = quant.quantize_fp4(x)
    assert packed.dtype == torch.int8 and scale.view(torch.uint8).tolist() == [[127]]
    assert packed.view(torch.uint8)[0, :2].tolist() == [0x21, 0xF9]


def test_fp4_round_trip_within_e2m1_error():
    x = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(2)) * 0.1
    packed, scale = quant.quantize_fp4(x)
    assert packed.shape == (4, 64, 64) and scale.shape == (4, 64, 4)
    back = quant.dequantize_fp4(packed, scale, torch.float32)
    # one mantissa bit: within a quarter of the value, or a quarter of the scale near zero
    factor = quant.e8m0_to_float32(scale).repeat_interleave(32, -1)
    assert ((back - x).abs() <= torch.maximum(x.abs() / 4, factor / 4)).all()
    assert (x.abs() <= 6 * factor).all()  # the scale never clips a group's largest value


# -- the loader --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dsv41") / "tiny")
    write_tiny(out, seed=0, n_mtp_layers=2)
    return out


@pytest.fixture
def tiny(tiny_source, tmp_path):
    return shutil.copytree(tiny_source, tmp_path / "tiny")


def edit_shard(folder, edit, shard=SHARD2):
    """Apply edit(tensors) to a shard's {name: tensor} and keep the index in step."""
    path = os.path.join(folder, shard)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(folder, INDEX_FILE)) as f:
        index = json.load(f)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != shard}
    index["weight_map"].update({n: shard for n in tensors})
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f)


def overwrite_bytes(folder, name, byte=0x3F):
    """Overwrite a stored tensor's bytes in place in its shard (header untouched)."""
    with open(os.path.join(folder, INDEX_FILE)) as f:
        path = os.path.join(folder, json.load(f)["weight_map"][name])
    with open(path, "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        begin, end = json.loads(f.read(size))[name]["data_offsets"]
        f.seek(8 + size + begin)
        f.write(bytes([byte]) * (end - begin))


def test_loads_dequantised_weights_keyed_by_checkpoint_names(tiny):
    loaded = checkpoint.load(tiny, dtype=torch.bfloat16)
    w = loaded.weights
    assert loaded.config.n_mtp_layers == 2 and loaded.config.expert_dtype == "fp4"
    # main_proj; per layer wq_a, wq_b, wkv, wo_a, wo_b, the shared expert w1 w2 w3, 4 experts x 3
    assert not any(n.endswith(".scale") for n in w) and len(loaded.scales) == 1 + 2 * (5 + 3 + 4 * 3)
    assert w["mtp.0.attn.wq_a.weight"].shape == (192, 256) and w["mtp.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert w["mtp.1.ffn.experts.3.w2.weight"].shape == (256, 128)  # unpacked from (256, 64) bytes
    assert w["mtp.0.attn.attn_sink"].dtype == torch.float32       # float32 stays float32
    with safe_open(os.path.join(tiny, SHARD2), "pt") as f:
        stored, scale = f.get_tensor("mtp.0.attn.wq_b.weight"), f.get_tensor("mtp.0.attn.wq_b.scale")
    assert torch.equal(w["mtp.0.attn.wq_b.weight"], quant.dequantize_fp8(stored, scale, torch.bfloat16))
    # the toy values are scaled for a sane forward: unit-scale rows through every linear
    assert abs(w["mtp.0.attn.wq_b.weight"].float().std().item() * 192 ** 0.5 - 1) < 0.1
    assert all(torch.isfinite(t.float()).all() for t in w.values())


@pytest.mark.parametrize("edit, named, why", [
    (lambda t: t.pop("mtp.1.attn.wkv.weight"), "mtp.1.attn.wkv.weight", "missing"),
    (lambda t: t.pop("mtp.0.ffn.experts.2.w3.scale"), "mtp.0.ffn.experts.2.w3.scale", "missing"),
    (lambda t: t.update({"mtp.0.attn.wq_c.weight": torch.zeros(4, dtype=torch.bfloat16)}),
     "mtp.0.attn.wq_c.weight", "extra"),
    (lambda t: t.update({"mtp.2.norm.weight": torch.zeros(256, dtype=torch.bfloat16)}),
     "mtp.2.norm.weight", "extra"),
    (lambda t: t.update({"mtp.0.attn.q_norm.weight": torch.ones(128, dtype=torch.bfloat16)}),
     "mtp.0.attn.q_norm.weight", r"shape \[128\], expected \[192\]"),
    (lambda t: t.update({"mtp.1.attn.wo_b.scale": torch.ones(2, 2, dtype=torch.uint8)}),
     "mtp.1.attn.wo_b.scale", r"shape \[2, 2\], expected \[2, 1\]"),
    (lambda t: t.update({"mtp.0.attn.wq_b.weight": torch.zeros(512, 192, dtype=torch.bfloat16)}),
     "mtp.0.attn.wq_b.weight", "stored as BF16, expected fp8"),
    (lambda t: t.update({"mtp.0.attn.attn_sink": torch.zeros(4, dtype=torch.bfloat16)}),
     "mtp.0.attn.attn_sink", "stored as BF16, expected f32"),
    (lambda t: t.update({"mtp.1.ffn.experts.0.w1.scale": torch.ones(128, 8)}),
     "mtp.1.ffn.experts.0.w1.scale", "stored as F32, expected e8m0"),
])
def test_refuses_a_tensor_off_deepseeks_table_by_name(tiny, edit, named, why):
    edit_shard(tiny, edit)
    with pytest.raises(ValueError, match=f"{named}: {why}"):
        checkpoint.load(tiny)
    assert any(p.startswith(named) for p in checkpoint.describe(tiny)["problems"])


def test_a_checkpoint_without_confidence_head_loads_without_it(tiny):
    edit_shard(tiny, lambda t: t.pop("mtp.1.confidence_head.proj.weight"))
    loaded = checkpoint.load(tiny, dtype=torch.float32)
    assert not loaded.config.enable_confidence_head  # as vLLM drops it
    assert not any("confidence_head" in n for n in loaded.weights)


def test_trunk_tensors_are_never_read(tiny, monkeypatch):
    # a trunk-only shard that does not even exist is never opened
    with open(os.path.join(tiny, INDEX_FILE)) as f:
        index = json.load(f)
    index["weight_map"]["layers.1.attn.wkv.weight"] = "model-trunk-only.safetensors"
    with open(os.path.join(tiny, INDEX_FILE), "w") as f:
        json.dump(index, f)
    read = []

    class Spy:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            read.append(name)
            return self.file.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(checkpoint, "safe_open", Spy)
    loaded = checkpoint.load(tiny, dtype=torch.float32)
    checkpoint.describe(tiny)
    assert read and all(checkpoint.is_drafter_tensor(n) for n in read)
    assert {n for n in index["weight_map"] if checkpoint.is_drafter_tensor(n)} <= set(read)
    assert not any(n.startswith(("layers.", "norm.")) for n in loaded.weights)


def test_digests_follow_the_drafters_tensors_only(tiny):
    base = checkpoint.load(tiny, dtype=torch.float32)
    overwrite_bytes(tiny, "layers.0.attn.wq_a.weight")  # trunk, in the shard with embed
    overwrite_bytes(tiny, "norm.weight")                # trunk, in the shard with mtp.*
    same = checkpoint.load(tiny, dtype=torch.float32)
    assert (same.drafter_digest, same.markov_digest) == (base.drafter_digest, base.markov_digest)
    overwrite_bytes(tiny, "mtp.0.ffn.experts.1.w1.scale", 0x7F)
    scaled = checkpoint.load(tiny, dtype=torch.float32)
    assert scaled.drafter_digest != base.drafter_digest and scaled.markov_digest == base.markov_digest
    overwrite_bytes(tiny, "mtp.1.markov_head.head.weight")
    markov = checkpoint.load(tiny, dtype=torch.float32)
    assert markov.drafter_digest == scaled.drafter_digest and markov.markov_digest != base.markov_digest


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4")
def test_experts_stored_as_f4_read_as_int8_pairs_do(tiny):
    name = "mtp.0.ffn.experts.0.w1.weight"
    as_int8 = checkpoint.load(tiny, dtype=torch.float32)
    edit_shard(tiny, lambda t: t.update({name: t[name].view(torch.float4_e2m1fn_x2)}))
    # safetensors counts 128 x 256 values; held as 128 x 128 pairs, as int8 was
    assert checkpoint.describe(tiny)["tensors"][name] == {"shape": [128, 128], "dtype": "F4",
                                                          "bytes": 128 * 256 // 2}
    as_f4 = checkpoint.load(tiny, dtype=torch.float32)
    assert torch.equal(as_f4.weights[name], as_int8.weights[name])
    assert as_f4.drafter_digest == as_int8.drafter_digest  # the same bytes


def test_one_model_safetensors_loads_the_same(tiny, tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(os.path.join(tiny, "config.json"), single / "config.json")
    merged = {}
    for shard in ("model-00001-of-00002.safetensors", SHARD2):
        merged.update(load_file(os.path.join(tiny, shard)))
    save_file(merged, str(single / "model.safetensors"))
    one, sharded = checkpoint.load(str(single)), checkpoint.load(tiny)
    assert one.drafter_digest == sharded.drafter_digest and one.weights.keys() == sharded.weights.keys()


def test_describe_totals_match_the_load(tiny):
    d = checkpoint.describe(tiny)
    loaded = checkpoint.load(tiny, dtype=torch.bfloat16)
    assert d["loaded_bytes_bf16"] == sum(t.numel() * t.element_size() for t in loaded.weights.values())
    with open(os.path.join(tiny, INDEX_FILE)) as f:
        index = json.load(f)
    assert d["stored_bytes"] + sum(  # the index's total is the drafter's plus the trunk's
        t.numel() * t.element_size() for n, t in load_file(os.path.join(tiny, SHARD2)).items()
        if not checkpoint.is_drafter_tensor(n)) + sum(
        t.numel() * t.element_size() for n, t in load_file(
            os.path.join(tiny, "model-00001-of-00002.safetensors")).items()
        if not checkpoint.is_drafter_tensor(n)) == index["metadata"]["total_size"]
    assert d["trunk_tensors"] == 6 and d["scales"] == len(loaded.scales) and not d["problems"]


# -- DeepSeek-V4 (variant v4) -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dsv4") / "tiny")
    write_tiny(out, seed=0, n_mtp_layers=2, variant="v4")
    return out


def test_a_v4_checkpoint_loads_with_its_own_names_and_the_targets_expert_counts(tiny_v4, tmp_path):
    folder = shutil.copytree(tiny_v4, tmp_path / "v4")
    loaded = checkpoint.load(folder, dtype=torch.float32)
    c, w = loaded.config, loaded.weights
    assert c.variant == "v4" and c.name == "DeepSeek-V4" and c.n_mtp_layers == 2
    assert c.hc_head and c.q_head_norm and not c.delayed_mhc
    assert w["mtp.1.hc_head_fn"].shape == (4, 4 * 256) and w["mtp.1.hc_head_scale"].shape == (1,)
    assert w["mtp.1.hc_head_base"].dtype == torch.float32
    assert w["mtp.1.markov_head.markov_w1.weight"].shape == (1024, 32)
    assert w["mtp.1.markov_head.markov_w2.weight"].shape == (1024, 32)  # stored [vocab, rank]
    assert not any(".markov_head.embed." in n or ".markov_head.head." in n for n in w)
    assert c.n_routed_experts == 4 and "mtp.0.ffn.experts.3.w1.weight" in w
    # the Markov factors are digested apart, under their V4 names too
    overwrite_bytes(folder, "mtp.1.markov_head.markov_w2.weight")
    again = checkpoint.load(folder, dtype=torch.float32)
    assert again.drafter_digest == loaded.drafter_digest and again.markov_digest != loaded.markov_digest


def test_a_v4_config_is_read_as_vllm_reads_deepseek_v4(tiny_v4):
    from remote_drafter.models.dsv41.config import Dsv41DrafterConfig
    with open(os.path.join(tiny_v4, "config.json")) as f:
        config = json.load(f)
    assert config["num_nextn_predict_layers"] == 1 and "text_config" not in config
    c = Dsv41DrafterConfig.from_json(config)
    assert c.n_mtp_layers == 2  # n_mtp_layers counts V4's stages (num_nextn_predict_layers: not)
    # V4.1's drafter-only expert counts are V4.1's alone; a V4 drafter layer is never compressed
    c = Dsv41DrafterConfig.from_json({**config, "dspark_n_routed_experts": 2,
                                      "compress_ratios": [4] * 10})
    assert c.n_routed_experts == 4
    # transformers' DeepseekV4Config: rope dims = head_dim x partial_rotary_factor
    assert Dsv41DrafterConfig.from_json({**config, "partial_rotary_factor": 0.5}).qk_rope_head_dim == 64
    # V4's quant config reads expert_dtype off the top level only (default fp4)
    quant = {**config["quantization_config"], "expert_dtype": "fp8"}
    assert Dsv41DrafterConfig.from_json({**config, "quantization_config": quant}).expert_dtype == "fp4"
    # transformers (1.5) and exllamav3 (1.0) default it differently: it must be given
    with pytest.raises(ValueError, match="DeepSeek-V4 drafter config lacks 'routed_scaling_factor'"):
        Dsv41DrafterConfig.from_json({k: v for k, v in config.items() if k != "routed_scaling_factor"})
    with pytest.raises(ValueError, match="model_type 'deepseek_v3'"):
        Dsv41DrafterConfig.from_json({**config, "model_type": "deepseek_v3"})


def test_a_v4_checkpoint_with_v41_names_is_refused_by_name(tiny_v4, tmp_path):
    folder = shutil.copytree(tiny_v4, tmp_path / "v4")

    def as_v41(t):
        t["mtp.1.markov_head.embed.weight"] = t.pop("mtp.1.markov_head.markov_w1.weight")
        t.pop("mtp.1.hc_head_fn")

    edit_shard(folder, as_v41)
    with pytest.raises(ValueError, match="not hold DeepSeek-V4's drafter") as refused:
        checkpoint.load(folder)
    for named in ("mtp.1.hc_head_fn: missing", "mtp.1.markov_head.markov_w1.weight: missing",
                  "mtp.1.markov_head.embed.weight: extra"):
        assert named in str(refused.value)


@pytest.mark.parametrize("variant", ["v41", "v4"])
def test_an_unquantized_checkpoint_stores_every_linear_bf16_unscaled(tmp_path, variant):
    out = str(tmp_path / variant)
    write_tiny(out, seed=0, n_mtp_layers=1, variant=variant, quantized=False)
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    d = checkpoint.describe(out)
    assert not d["problems"] and d["scales"] == 0
    assert d["tensors"]["mtp.0.attn.wq_b.weight"]["dtype"] == "BF16"
    assert d["tensors"]["mtp.0.ffn.experts.0.w1.weight"] == {"shape": [128, 256], "dtype": "BF16",
                                                             "bytes": 128 * 256 * 2}
    loaded = checkpoint.load(out, dtype=torch.float32)
    assert not loaded.config.quantized and not loaded.scales
    with safe_open(os.path.join(out, SHARD2), "pt") as f:
        assert torch.equal(loaded.weights["mtp.0.attn.wq_b.weight"],
                           f.get_tensor("mtp.0.attn.wq_b.weight").float())


def test_a_full_v4_trunk_is_every_layer_of_the_drafters_sizes(tmp_path):
    out = str(tmp_path / "v4")
    made = write_tiny(out, seed=0, n_mtp_layers=1, variant="v4", quantized=False, full_trunk=True,
                      config_overrides={"num_hidden_layers": 2, "dspark_target_layer_ids": [0, 1]})
    assert made["config"]["compress_ratios"] == [0, 0, 0]  # exllamav3 counts stages by its tail
    names = set(load_file(os.path.join(out, "model-00001-of-00002.safetensors"))) | set(
        load_file(os.path.join(out, SHARD2)))
    layer = {n.removeprefix("mtp.0.") for n in names if n.startswith("mtp.0.")} - {
        "main_proj.weight", "main_norm.weight", "norm.weight", "hc_head_fn", "hc_head_base",
        "hc_head_scale", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
        "confidence_head.proj.weight"}
    for i in (0, 1):
        assert {n.removeprefix(f"layers.{i}.") for n in names if n.startswith(f"layers.{i}.")} == layer
    assert {"norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "embed.weight",
            "head.weight"} <= names
    assert checkpoint.describe(out)["trunk_tensors"] == made["trunk"] == 2 * len(layer) + 4
    with pytest.raises(ValueError, match="variant='v4'"):
        write_tiny(str(tmp_path / "v41"), variant="v41", full_trunk=True)


# -- the CLI -----------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([sys.executable, "-m", "remote_drafter.cli", *args],
                          capture_output=True, text=True)


def test_tiny_dsv41_then_inspect(tmp_path, capsys):
    out = str(tmp_path / "fp8")
    made = cli("tiny-dsv41", out, "--experts-dtype", "fp8", "--layers", "1", "--seed", "3")
    assert made.returncode == 0 and "fp8 experts" in made.stdout, made.stderr
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["text_config"]["n_mtp_layers"] == 1
    shown = cli("inspect", out, "--json")
    assert shown.returncode == 0, shown.stderr
    d = json.loads(shown.stdout)
    assert d["config"]["expert_dtype"] == "fp8" and not d["problems"]
    assert d["tensors"]["mtp.0.ffn.experts.0.w1.weight"]["dtype"] == "F8_E4M3"
    assert d["tensors"]["mtp.0.attn.wq_a.scale"]["dtype"] == "F32"  # Flash-Base: float32 scales
    assert not any(n.startswith("layers.") for n in d["tensors"])
    # the table, in process (a subprocess apiece costs seconds)
    assert main(["inspect", out]) == 0
    text = capsys.readouterr().out
    assert "6 target tensors not read" in text
    assert "mtp.0.ffn.experts.*.w1.weight" in text  # experts on one line each
    edit_shard(out, lambda t: t.pop("mtp.0.attn.wkv.scale"))
    assert main(["inspect", out]) == 1
    assert "problem: mtp.0.attn.wkv.scale: missing" in capsys.readouterr().out
    v4 = str(tmp_path / "v4")
    assert main(["tiny-dsv41", v4, "--variant", "v4", "--unquantized", "--layers", "1"]) == 0
    assert "(v4, " in capsys.readouterr().out
    assert main(["inspect", v4]) == 0
    text = capsys.readouterr().out
    assert "DeepSeek-V4: hidden 256" in text and "mtp.0.hc_head_fn" in text
