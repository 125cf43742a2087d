"""EXL3 weights without a GPU: every refusal is one line, nothing imports exllamav3, and the
one place DeepSeek's drafter applies a linear serves callables exactly as its dense weights
(the EXL3 kernels themselves run in benchmarks/exl3_gpu.py, findings/exl3-drafter.md)."""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

import remote_drafter.cli  # noqa: E402
from remote_drafter.models import exl3  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint, tiny  # noqa: E402
from remote_drafter.models.dsv41.config import linear_names, markov_names  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402


def test_refusals_name_the_missing_piece(monkeypatch):
    assert "--device cuda" in exl3.refusal("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA GPU" in exl3.refusal("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(exl3.importlib.util, "find_spec", lambda name: None)
    assert exl3.EXTRA in exl3.refusal("cuda:0")


@pytest.mark.parametrize("argv", [
    ["worker", "--drafter", "dsv41:/nowhere", "--weights", "exl3"],
    ["worker", "--drafter", "/nowhere", "--weights", "exl3", "--device", "cuda:0"],
    ["exl3", "convert", "/nowhere", "/tmp/out", "--bits", "4"],
])
def test_cli_refuses_exl3_in_one_line_without_a_gpu(argv, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert remote_drafter.cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and ("CUDA" in err or "cuda" in err), err
    assert "exllamav3" not in sys.modules


def test_a_folder_without_a_pack_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(exl3, "refusal", lambda device: None)  # as if on a GPU with exllamav3
    assert remote_drafter.cli.main(["worker", "--drafter", f"dsv41:{tmp_path}", "--weights", "exl3",
                                    "--device", "cuda:0"]) == 2
    assert "exl3 convert" in capsys.readouterr().err
    assert "exllamav3" not in sys.modules


def test_pack_metadata_round_trips(tmp_path):
    exl3.write_pack(str(tmp_path), {"kind": "dspark", "bits": 4, "linears": ["ctx_proj.weight"]})
    assert exl3.is_pack(str(tmp_path)) and exl3.read_pack(str(tmp_path))["bits"] == 4
    meta = json.loads((tmp_path / exl3.PACK_FILE).read_text())
    (tmp_path / exl3.PACK_FILE).write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        exl3.read_pack(str(tmp_path))
    assert exl3.padded(576) == 640 and exl3.padded(1024) == 1024
    assert exl3.is_exl3_tensor("mtp.0.attn.wq_a.trellis") and not exl3.is_exl3_tensor("mtp.0.attn.wq_a.weight")


@pytest.mark.parametrize("variant", ["v41", "v4"])
def test_served_linears_replace_dense_weights_exactly(tmp_path, variant):
    """Every linear an EXL3 pack quantises, served as a callable (wo_a per group, as
    exl3.Exl3Groups takes it), gives the dense model's block bit for bit; the dense tensors
    are then not held."""
    tiny.write_tiny(str(tmp_path), variant=variant)
    loaded = checkpoint.load(str(tmp_path), torch.float64)
    c, w = loaded.config, loaded.weights
    dense = Dsv41Model(c, w)
    served = {}
    for name in linear_names(c) + ["head.weight"]:
        if name.endswith(".attn.wo_a.weight"):
            groups = w[name].view(c.o_groups, c.o_lora_rank, -1)
            served[name] = lambda x, g=groups: torch.stack([x[..., i, :] @ g[i].T for i in range(len(g))], -2)
        else:
            served[name] = lambda x, m=w[name]: x @ m.T
    other = Dsv41Model(c, {n: t for n, t in w.items() if n not in served}, linears=served)
    assert not set(served) & {n for n, _ in other.named_tensors()}
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 16, c.n_mtp_layers, c.head_dim, generator=gen, dtype=torch.float64)
    valid = torch.ones(2, 16, dtype=torch.bool)
    seed, p0 = torch.tensor([3, 5]), torch.tensor([20, 40])
    h = dense.block_hidden(ctx, valid, seed, p0)
    assert torch.equal(h, other.block_hidden(ctx, valid, seed, p0))
    assert torch.equal(dense.head(h), other.head(h))
    taps = torch.randn(4, c.feature_width, generator=gen, dtype=torch.float64)
    assert torch.equal(dense.encode_rows(taps, torch.arange(4)), other.encode_rows(taps, torch.arange(4)))


def test_zero_dim_tensors_are_digested_as_their_bytes():
    """exllamav3 stores markers (mul1) as 0-dim tensors; a pack's identity digests them too
    (seen on the H200: the first tiny V4.1 pack failed to load on one)."""
    from remote_drafter.models.tensors import tensor_bytes
    assert tensor_bytes(torch.tensor(3, dtype=torch.int32)) == (3).to_bytes(4, "little")
    assert tensor_bytes(torch.tensor([1, 2], dtype=torch.int16)) == b"\x01\x00\x02\x00"


def exllamav3_style(src, out, variant: str = "v4", mtp_bits16: bool = False) -> list[str]:
    """A tiny checkpoint re-stored as exllamav3's convert_model stores a converted model:
    config.json with quant_method "exl3", every drafter linear as trellis / suh / svh / mul1
    (wo_a in group slices, the head too), the rest fp16, one trunk tensor beside them.
    mtp_bits16: the drafter's linears kept fp16 (`--mtp_bits 16`; wo_a still in slices), the
    head alone quantised."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    tiny.write_tiny(str(src), variant=variant, quantized=False)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "exl3", "bits": 4.0, "head_bits": 6.0, "mtp_bits": 4.0}
    c = checkpoint.load(str(src)).config
    state = {}
    for name, file in checkpoint.tensor_files(str(src)).items():
        with safe_open(file, "pt") as f:
            state[name] = f.get_tensor(name)
    stored = {"layers.0.attn.wq_a.trellis": torch.zeros(1, dtype=torch.int16)}  # the trunk's
    quantised = []
    for name, t in state.items():
        module = name.removesuffix(".weight")
        parts = ([(f"{module}.slice.{g}", c.o_lora_rank) for g in range(c.o_groups)]
                 if name.endswith(".attn.wo_a.weight") else [(module, t.shape[0])])
        if mtp_bits16 and name in linear_names(c):
            stored |= {f"{key}.weight": w.half().contiguous()
                       for (key, _), w in zip(parts, t.split(c.o_lora_rank if len(parts) > 1 else len(t)))}
        elif name in linear_names(c) or name == "head.weight":
            quantised.append(name)
            for key, n_out in parts:
                k, n = -(-t.shape[1] // 16) * 16, -(-n_out // 16) * 16
                stored |= {f"{key}.trellis": torch.zeros(k // 16, n // 16, 64, dtype=torch.int16),
                           f"{key}.suh": torch.ones(k, dtype=torch.half),
                           f"{key}.svh": torch.ones(n, dtype=torch.half),
                           f"{key}.mul1": torch.tensor(0, dtype=torch.int32)}
        else:
            stored[name] = t.half() if t.is_floating_point() and t.dtype != torch.float32 else t
            if name == markov_names(c)[1]:  # a Linear it keeps unquantised: padded to 128
                stored[name] = torch.nn.functional.pad(stored[name], (0, 128 - t.shape[1]))
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file(stored, str(out / "model.safetensors"))
    return quantised


@pytest.mark.parametrize("variant", ["v41", "v4"])
def test_a_model_exllamav3_converted_loads_by_deepseeks_names(tmp_path, monkeypatch, variant):
    """exllamav3's own conversion of a DeepSeek-V4 model is a pack: each linear it quantised
    is served from its trellis tensors (wo_a by group slice), every other weight read as
    stored, the trunk not read; a mis-shaped or missing weight is refused by name. (The
    kernels on such a pack, against exllamav3's own drafter, run in
    benchmarks/dsv4_exl3_check.py on the GPU.)"""
    from remote_drafter.models.dsv41 import exl3_pack
    quantised = exllamav3_style(tmp_path / "src", tmp_path / "exl3", variant)
    folder = str(tmp_path / "exl3")
    assert exl3.is_pack(folder) and exl3.made_by_exllamav3(folder)
    assert not exl3.is_pack(str(tmp_path / "src"))
    monkeypatch.setattr(exl3, "require", lambda device: None)
    monkeypatch.setattr(exl3, "linear_from", lambda state, module, shape, device: ("exl3", module, shape))
    monkeypatch.setattr(exl3, "Exl3Groups", lambda groups: ("groups", groups))
    loaded = exl3_pack.load(folder, torch.float32, "cpu")
    assert sorted(loaded.linears) == sorted(quantised)
    c = loaded.config
    for name, served in loaded.linears.items():
        if name.endswith(".attn.wo_a.weight"):
            assert served[0] == "groups" and [g[1] for g in served[1]] == [
                f"{name.removesuffix('.weight')}.slice.{g}" for g in range(c.o_groups)]
        else:
            assert served == ("exl3", name.removesuffix(".weight"), checkpoint.weight_table(c)[name][0])
    assert not set(loaded.linears) & set(loaded.weights)
    assert loaded.weights["embed.weight"].dtype == torch.float32 and loaded.not_read == []
    again = exl3_pack.load(folder, torch.float32, "cpu")
    assert (again.drafter_digest, again.markov_digest) == (loaded.drafter_digest, loaded.markov_digest)

    from safetensors.torch import load_file, save_file
    state = load_file(f"{folder}/model.safetensors")
    w2 = markov_names(c)[1]
    assert state[w2].shape[1] == 128 and loaded.weights[w2].shape[1] == c.markov_rank
    assert torch.equal(loaded.weights[w2], state[w2][:, :c.markov_rank].float())
    bad = state[w2].clone()
    bad[0, -1] = 1.0  # padding that is not zeros: not exllamav3's padding
    save_file({**state, w2: bad}, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match="zero-padded"):
        exl3_pack.load(folder, torch.float32, "cpu")
    norm = "mtp.0.attn_norm.weight"
    save_file({**state, norm: state[norm][:-1].contiguous()}, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match=rf"{norm}: shape"):
        exl3_pack.load(folder, torch.float32, "cpu")
    del state[norm]
    save_file(state, f"{folder}/model.safetensors")
    with pytest.raises(ValueError, match=rf"{norm}: missing"):
        exl3_pack.load(folder, torch.float32, "cpu")


@pytest.mark.parametrize("variant", ["v41", "v4"])
def test_every_expert_on_every_row_is_the_chosen_experts_sum(tmp_path, variant):
    """Served (EXL3) experts under CUDA graphs run each expert on every row, weighted by its
    routing weight, zero where not chosen: the same sum as running only the chosen ones."""
    tiny.write_tiny(str(tmp_path), variant=variant)
    loaded = checkpoint.load(str(tmp_path), torch.float64)
    c, w = loaded.config, loaded.weights
    served = {n: (lambda x, m=w[n]: x @ m.T) for n in linear_names(c) if ".ffn.experts." in n}
    model = Dsv41Model(c, {n: t for n, t in w.items() if n not in served}, linears=served)
    gen = torch.Generator().manual_seed(1)
    block = (torch.randn(3, 16, c.n_mtp_layers, c.head_dim, generator=gen, dtype=torch.float64),
             torch.ones(3, 16, dtype=torch.bool), torch.tensor([3, 5, 7]), torch.tensor([20, 40, 9]))
    chosen = model.block_hidden(*block)
    model.every_expert_on_every_row()
    every = model.block_hidden(*block)
    assert not torch.equal(chosen, torch.zeros_like(chosen))
    torch.testing.assert_close(every, chosen, rtol=1e-12, atol=1e-12)


def test_a_conversion_keeping_the_drafter_at_16_bits_serves_its_dense_weights(tmp_path, monkeypatch):
    """`convert_model --mtp_bits 16`: the drafter's linears are stored fp16 (wo_a by group
    slice), read as dense weights equal to the checkpoint's; only the head is served EXL3."""
    from remote_drafter.models.dsv41 import exl3_pack
    exllamav3_style(tmp_path / "src", tmp_path / "exl3", "v4", mtp_bits16=True)
    monkeypatch.setattr(exl3, "require", lambda device: None)
    monkeypatch.setattr(exl3, "linear_from", lambda state, module, shape, device: ("exl3", module, shape))
    loaded = exl3_pack.load(str(tmp_path / "exl3"), torch.float32, "cpu")
    assert sorted(loaded.linears) == ["head.weight"] and loaded.not_read == []
    source = checkpoint.load(str(tmp_path / "src"), torch.float32).weights
    for name in linear_names(loaded.config):
        assert torch.equal(loaded.weights[name], source[name].half().float()), name
