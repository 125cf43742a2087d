"""Shard format: header, round trips, offsets beyond 4 GiB, digests, pack and --check."""

import os

import numpy as np
import pytest

from remote_engram.cli import main as cli
from remote_engram.dequant import E4M3, dequantize
from remote_engram.pack import check, pack
from remote_engram.shard import HEADER_BYTES, MAGIC, ShardHeader, ShardReader, ShardWriter
from remote_engram.synth import synthetic_rows, write_checkpoint
from remote_engram.testing import SMALL


def test_header_layout_is_six_le_u64():
    raw = ShardHeader(14, 100, 300, 1000).pack()
    assert len(raw) == HEADER_BYTES
    # ARCHITECTURE.md § Shard format: the magic is the u64 0x31344E4531565344 ("DSV41EN1");
    # stored little-endian, that value's bytes read "DSV1EN41". The u64 is what readers check.
    assert MAGIC == 0x31344E4531565344 and raw[:8] == b"DSV1EN41"
    words = np.frombuffer(raw[:48], "<u8").tolist()
    assert words == [MAGIC, 14, 100, 300, 1000, 264] and not any(raw[48:])


def test_round_trip_and_validation(tmp_path):
    path = tmp_path / "s.bin"
    rows = synthetic_rows(3, 1, 500, 200)
    with ShardWriter(path, ShardHeader(1, 500, 700, 5000)) as w:
        w.write_rows(500, rows)
        with pytest.raises(ValueError, match="outside"):
            w.write_rows(650, rows)
    with ShardReader(path) as r:
        assert np.array_equal(r.rows([500, 699, 600]), rows[[0, 199, 100]])
        assert r.row(501).base is not None  # a view, not a copy
        with pytest.raises(ValueError, match="must lie in"):
            r.rows([700])
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"NOTASHARD" + bytes(5000))
    with pytest.raises(ValueError, match="not an Engram shard"):
        ShardReader(bad)
    os.truncate(path, os.path.getsize(path) - 1)
    with pytest.raises(ValueError, match="header says"):
        ShardReader(path)


def test_offsets_beyond_4_gib_in_a_sparse_file(tmp_path):
    path = tmp_path / "big.bin"
    lo, n = 1_000_000, 20_000_000  # 5.3 GB of rows, almost all holes
    with ShardWriter(path, ShardHeader(14, lo, lo + n, lo + n)) as w:
        tail = synthetic_rows(1, 14, lo + n - 3, 3)
        w.write_rows(lo + n - 3, tail)
    assert os.path.getsize(path) == HEADER_BYTES + n * 264 > 4 << 30
    with ShardReader(path) as r:
        assert np.array_equal(r.rows([lo + n - 1, lo + n - 3]), tail[[2, 0]])
        assert not r.rows([lo]).any()


def test_digest_sees_a_changed_row(tmp_path):
    path = tmp_path / "d.bin"
    with ShardWriter(path, ShardHeader(1, 0, 1000, 1000)) as w:
        w.write_rows(0, synthetic_rows(0, 1, 0, 1000))
    with ShardReader(path) as r:
        before = r.digest()
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 777 * 264 + 5)
        f.write(b"\xff")
    with ShardReader(path) as r:
        assert r.digest() != before


def test_pack_writes_bytes_unchanged_and_check_finds_changes(tmp_path):
    ck = str(tmp_path / "ck.safetensors")
    write_checkpoint(ck, SMALL, seed=4)
    paths = pack(ck, str(tmp_path / "shards"), SMALL)
    assert len(paths) == 4 and all(check(p, ck) == [] for p in paths)
    with ShardReader(paths[3]) as r:
        lo = r.lo
        assert np.array_equal(r.rows([lo, lo + 10]), synthetic_rows(4, 14, lo, 11)[[0, 10]])
    with open(paths[3], "r+b") as f:
        f.seek(HEADER_BYTES + 10 * 264 + 260)  # a scale byte of row lo + 10
        f.write(b"\x00")
    problems = check(paths[3], ck)
    assert problems and f"first {lo + 10}" in problems[0]
    assert cli(["pack", ck, "--out", str(tmp_path / "again"), "--check",
                "--prime-start", "1000", "--vocab", "500"]) == 0


def test_dequantize_known_values():
    assert E4M3[0x38] == 1.0 and E4M3[0x40] == 2.0 and E4M3[0x7E] == 448.0
    assert E4M3[0x01] == 2.0 ** -9 and E4M3[0xB8] == -1.0 and np.isnan(E4M3[0x7F])
    row = np.zeros((1, 264), np.uint8)
    row[0, :256] = 0x38          # all 1.0
    row[0, 256:] = 127           # 2^0 ...
    row[0, 257] = 130            # ... except values 32..63: 2^3
    out = dequantize(row)
    assert out.shape == (1, 256) and (out[0, :32] == 1).all() and (out[0, 32:64] == 8).all()


def test_dequantize_matches_torch_float8():
    torch = pytest.importorskip("torch", reason="torch is not in this venv (the torch-free "
                                "check); the main .venv has it and runs this")
    rows = synthetic_rows(9, 1, 0, 50)
    want = torch.from_numpy(rows[:, :256].copy()).view(torch.float8_e4m3fn).float()
    scale = torch.from_numpy(rows[:, 256:].copy()).view(torch.float8_e8m0fnu).float()
    want = (want.reshape(50, 8, 32) * scale[..., None]).reshape(50, 256)
    assert np.array_equal(dequantize(rows), want.numpy())
    from remote_engram.dequant import dequantize_bf16

    got = dequantize_bf16(rows)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
