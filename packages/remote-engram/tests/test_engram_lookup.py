"""The lookup contract in torch (remote_engram.vllm.lookup) and the overlay's RemoteRows,
without vLLM: rows as vLLM's kernel writes them (its own code is compared in the vLLM tier,
vllm_engram_check.py), padded heads and foreign ids as zeros, strided packed outputs,
prefetch then wait."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="engine side; the torch-free venv skips it, .venv runs it")

from remote_engram import env  # noqa: E402
from remote_engram.client import EngramClient  # noqa: E402
from remote_engram.dequant import dequantize  # noqa: E402
from remote_engram.synth import synthetic_rows, write_shards  # noqa: E402
from remote_engram.testing import SMALL  # noqa: E402
from remote_engram.vllm.lookup import HeadRange, table_rows, write_rows  # noqa: E402
from remote_engram.vllm.overlay import RemoteRows  # noqa: E402


def rows_of(layer, count, seed=0):
    return torch.from_numpy(synthetic_rows(seed, layer, 0, count))


def test_bf16_rows_are_the_dequantised_values_rounded_once():
    rows = rows_of(1, 64).reshape(8, 8, 264)
    out = torch.empty(8, 8, 256, dtype=torch.bfloat16)
    write_rows(rows, out)
    want = torch.from_numpy(dequantize(rows.numpy())).to(torch.bfloat16)
    assert torch.equal(out, want)
    assert out.abs().sum() > 0


def test_packed_rows_land_in_a_strided_output():
    rows = rows_of(1, 24).reshape(4, 6, 264)
    staging = torch.zeros(4, 2, 6, 264, dtype=torch.uint8)  # [T, layers, heads, bytes]
    write_rows(rows, staging[:, 1])
    assert torch.equal(staging[:, 1], rows) and not staging[:, 0].any()


def test_padded_heads_and_foreign_ids_read_zeros():
    # 5 heads over 2 ranks: rank 1 owns heads 3, 4 and a padded fifth slot
    heads = HeadRange(start=3, count=3, total=5, lo=300, hi=500)
    table = rows_of(1, 200)
    weight, scales = table[:, :256].contiguous().view(torch.float8_e4m3fn), table[:, 256:]
    indices = torch.tensor([[0, 100, 200, 310, 499], [0, 100, 200, 299, 500]])
    ids, owned = heads.owned(indices)
    assert owned.tolist() == [[True, True, False], [False, False, False]]
    rows = table_rows(weight, scales, heads, ids, owned)
    assert torch.equal(rows[0, 0], table[10]) and torch.equal(rows[0, 1], table[199])
    assert not rows[0, 2].any() and not rows[1].any()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lookup-shards"))
    write_shards(folder, SMALL, nranks=2)
    return folder


def test_remote_rows_fill_out_as_a_local_table_does(shards):
    rank, layer = 1, 14
    client = EngramClient(geometry=SMALL, rank=rank, shard_dir=shards)
    lo, hi = SMALL.rank_rows(layer, rank, 2)
    c0, c1 = SMALL.rank_columns(rank, 2)
    heads = HeadRange(c0, c1 - c0, SMALL.columns, lo, hi)
    table = rows_of(layer, SMALL.rows(layer))[lo:hi]
    weight, scales = table[:, :256].contiguous().view(torch.float8_e4m3fn), table[:, 256:]
    rng = np.random.default_rng(2)
    remote = RemoteRows(client, layer, heads)
    outs = []
    for _ in range(2):  # the second start finishes the first
        indices = torch.from_numpy(rng.integers(0, SMALL.rows(layer), (9, SMALL.columns)))
        indices[:, c0:c1] = torch.from_numpy(rng.integers(lo, hi, (9, c1 - c0)))
        indices[4] = -1  # a dead token
        out = torch.full((9, c1 - c0, 256), 7.0, dtype=torch.bfloat16)
        remote.start(indices, out)
        want = torch.empty_like(out)
        write_rows(table_rows(weight, scales, heads, *heads.owned(indices)), want)
        outs.append((out, want))
    remote.finish()
    for out, want in outs:
        assert torch.equal(out, want) and not out[4].any()
    assert client.stats["overlay_lookups"] == 2
    client.close()


def test_each_rank_takes_its_own_link(monkeypatch):
    monkeypatch.setenv("ENGRAM_REMOTE", "10.0.0.1:7480, 10.0.1.1:7480")
    assert [env.remote_for_rank(r) for r in (0, 1)] == ["10.0.0.1:7480", "10.0.1.1:7480"]
    with pytest.raises(ValueError, match="rank 2 has none"):
        env.remote_for_rank(2)
    monkeypatch.setenv("ENGRAM_REMOTE", "10.0.0.1:7480")
    assert env.remote_for_rank(1) == "10.0.0.1:7480"
    monkeypatch.delenv("ENGRAM_REMOTE")
    assert env.remote_for_rank(0) == ""


def test_without_prefetch_the_fetch_waits_for_the_layer(shards):
    client = EngramClient(geometry=SMALL, rank=0, shard_dir=shards)
    lo, hi = SMALL.rank_rows(1, 0, 2)
    heads = HeadRange(0, SMALL.columns // 2, SMALL.columns, lo, hi)
    indices = torch.from_numpy(np.random.default_rng(4).integers(lo, hi, (5, SMALL.columns)))
    out = torch.full((5, SMALL.columns // 2, 264), 7, dtype=torch.uint8)
    remote = RemoteRows(client, 1, heads, prefetch=False)
    remote.start(indices, out)
    assert client.stats["fetches"] == 0 and bool((out == 7).all())  # nothing yet
    remote.finish()
    ids, owned = heads.owned(indices)
    assert client.stats["fetches"] == 1 and owned.all()
    assert torch.equal(out, torch.from_numpy(client.fetch(1, ids.numpy())))
    client.close()
