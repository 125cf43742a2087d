"""EXL3 weights without a GPU: every refusal is one line, nothing imports exllamav3, and the
one place DeepSeek's drafter applies a linear serves callables exactly as its dense weights
(the EXL3 kernels themselves run in benchmarks/exl3_gpu.py, findings/exl3-drafter.md)."""

from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

import remote_drafter.cli  # noqa: E402
from remote_drafter import exl3  # noqa: E402
from remote_drafter.dsv41 import checkpoint, tiny  # noqa: E402
from remote_drafter.dsv41.model import Dsv41Model, linear_names  # noqa: E402


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
    assert not set(served) & set(other.w)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 16, c.n_mtp_layers, c.head_dim, generator=gen, dtype=torch.float64)
    valid = torch.ones(2, 16, dtype=torch.bool)
    seed, p0 = torch.tensor([3, 5]), torch.tensor([20, 40])
    h = dense.block_hidden(ctx, valid, seed, p0)
    assert torch.equal(h, other.block_hidden(ctx, valid, seed, p0))
    assert torch.equal(dense.logits(h), other.logits(h))
    taps = torch.randn(4, c.feature_width, generator=gen, dtype=torch.float64)
    assert torch.equal(dense.encode_rows(taps, torch.arange(4)), other.encode_rows(taps, torch.arange(4)))


def test_zero_dim_tensors_are_digested_as_their_bytes():
    """exllamav3 stores markers (mul1) as 0-dim tensors; a pack's identity digests them too
    (seen on the H200: the first tiny V4.1 pack failed to load on one)."""
    from remote_drafter.drafters.dspark import tensor_bytes
    assert tensor_bytes(torch.tensor(3, dtype=torch.int32)) == (3).to_bytes(4, "little")
    assert tensor_bytes(torch.tensor([1, 2], dtype=torch.int16)) == b"\x01\x00\x02\x00"
