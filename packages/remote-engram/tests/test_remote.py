"""Server + client over real processes (tcp, shm): fetched bytes equal the shard, and every
fallback drill (kill, stall, other tables, restart) still returns the exact rows."""

import os
import socket
import time

import numpy as np
import pytest

from ofl import Connection, RemoteError, wire
from ofl.testing import stop_process, wait_until
from remote_engram.cli import main as cli
from remote_engram.client import EngramClient, EngramUnavailable, server_health
from remote_engram.hashing import row_ids
from remote_engram.shard import ShardReader, shard_name
from remote_engram.testing import SMALL, EngramServeProcess

TOKEN_MAP = np.random.default_rng(11).integers(0, SMALL.vocab, 2000)


def local_rows(shard_dir, layer, rank, ids):
    with ShardReader(os.path.join(shard_dir, shard_name(layer, rank))) as r:
        return r.rows(np.asarray(ids).reshape(-1)).reshape(np.shape(ids) + (264,))


def random_ids(layer, rank, shape, seed=0):
    lo, hi = SMALL.rank_rows(layer, rank, 2)
    return np.random.default_rng(seed).integers(lo, hi, shape)


def client(engram_server, shard_dirs, rank=0, **kw):
    return EngramClient(geometry=SMALL, rank=rank, shard_dir=shard_dirs[0],
                        remote=engram_server.address, backend=engram_server.backend,
                        token_map=TOKEN_MAP, deadline_s=kw.pop("deadline_s", 2.0), **kw)


def test_remote_rows_equal_the_shard(engram_server, shard_dirs):
    for rank in (0, 1):
        c = client(engram_server, shard_dirs, rank)
        for layer in SMALL.layers:
            ids = random_ids(layer, rank, (3, 16, 12), seed=rank)
            ids[0, 0, :] = ids[1, 1, :]  # duplicates are fetched once
            assert np.array_equal(c.fetch(layer, ids), local_rows(shard_dirs[0], layer, rank, ids))
        assert c.stats["remote_rows"] == c.stats["unique_rows"] > 0
        assert c.stats["unique_rows"] < c.stats["rows"] and c.stats["fallbacks"] == 0
        c.close()


def test_fetch_tokens_and_prefetch(engram_server, shard_dirs):
    c = client(engram_server, shard_dirs, rank=1)
    tokens = np.random.default_rng(3).integers(0, 2000, (2, 50))
    handle = c.prefetch(tokens)
    rows = c.wait(handle, timeout=10)
    for layer in SMALL.layers:
        ids = row_ids(SMALL, layer, tokens, TOKEN_MAP, columns=SMALL.rank_columns(1, 2))
        assert rows[layer].shape == (2, 50, 12, 264)
        assert np.array_equal(rows[layer], local_rows(shard_dirs[0], layer, 1, ids))
    c.close()


def test_killed_server_falls_back_exactly_then_recovers(shard_dirs):
    srv = EngramServeProcess(shard_dirs[0], "tcp")
    c = EngramClient(geometry=SMALL, rank=0, shard_dir=shard_dirs[0], remote=srv.address,
                     backend="tcp", deadline_s=1.0, backoff_s=0.2)
    ids = random_ids(1, 0, (64, 12))
    want = local_rows(shard_dirs[0], 1, 0, ids)
    assert np.array_equal(c.fetch(1, ids), want) and c.stats["remote_rows"] > 0
    srv.proc.kill()
    srv.proc.wait()
    assert np.array_equal(c.fetch(1, ids), want)  # from the local shard
    assert c.stats["fallbacks"] == 1
    assert np.array_equal(c.fetch(1, ids), want)  # in back-off: local, link not tried
    assert c.stats["backoff_skips"] == 1
    srv2 = EngramServeProcess(shard_dirs[0], "tcp", port=srv.port)
    try:
        before = c.stats["remote_rows"]

        def fetched_remotely():  # local rows while the back-off lasts, the same bytes either way
            assert np.array_equal(c.fetch(1, ids), want)
            return c.stats["remote_rows"] > before
        wait_until(fetched_remotely, what="the remote path back after the back-off", timeout_s=30,
                   interval_s=0.02)
    finally:
        srv2.stop()
        c.close()


def test_stalled_server_hits_the_deadline_and_falls_back(shard_dirs):
    srv = EngramServeProcess(shard_dirs[0], "tcp")
    c = EngramClient(geometry=SMALL, rank=1, shard_dir=shard_dirs[0], remote=srv.address,
                     backend="tcp", deadline_s=0.3, backoff_s=60)
    ids = random_ids(14, 1, (8, 12))
    want = local_rows(shard_dirs[0], 14, 1, ids)
    assert np.array_equal(c.fetch(14, ids), want)
    stop_process(srv.proc.pid)  # returns once every thread is stopped
    try:
        t = time.monotonic()
        assert np.array_equal(c.fetch(14, random_ids(14, 1, (8, 12), seed=1)),
                              local_rows(shard_dirs[0], 14, 1, random_ids(14, 1, (8, 12), seed=1)))
        assert time.monotonic() - t < 2 and c.stats["fallbacks"] == 1
    finally:
        srv.stop()
        c.close()


def test_server_with_other_tables_is_refused(shard_dirs):
    other = EngramServeProcess(shard_dirs[1], "tcp")  # same geometry, different bytes
    c = EngramClient(geometry=SMALL, rank=0, shard_dir=shard_dirs[0], remote=other.address,
                     backend="tcp", deadline_s=2, backoff_s=60)
    try:
        ids = random_ids(1, 0, (10, 12))
        assert np.array_equal(c.fetch(1, ids), local_rows(shard_dirs[0], 1, 0, ids))
        assert c.stats["manifest_rejections"] == 1 and c.stats["remote_rows"] == 0
    finally:
        other.stop()
        c.close()


def test_restart_with_other_tables_is_refused_mid_session(shard_dirs):
    srv = EngramServeProcess(shard_dirs[0], "tcp")
    c = EngramClient(geometry=SMALL, rank=0, shard_dir=shard_dirs[0], remote=srv.address,
                     backend="tcp", deadline_s=2, backoff_s=0.1)
    ids = random_ids(14, 0, (10, 12))
    want = local_rows(shard_dirs[0], 14, 0, ids)
    assert np.array_equal(c.fetch(14, ids), want)
    srv.stop()
    other = EngramServeProcess(shard_dirs[1], "tcp", port=srv.port)
    try:
        def rejected():
            assert np.array_equal(c.fetch(14, ids), want)  # never the other table's bytes
            return c.stats["manifest_rejections"] >= 1
        wait_until(rejected, what="the other table's server refused by its manifest", timeout_s=30,
                   interval_s=0.02)
    finally:
        other.stop()
        c.close()


def test_no_local_shard_and_no_server_is_an_error(shard_dirs):
    c = EngramClient(geometry=SMALL, rank=0, remote="127.0.0.1:1", backend="tcp", deadline_s=0.5)
    assert c.fetch(1, np.empty((0, 12), np.int64)).shape == (0, 12, 264)  # nothing to fetch
    with pytest.raises(EngramUnavailable):
        c.fetch(1, random_ids(1, 0, (2, 12)))
    c.close()


def test_client_refuses_ids_outside_its_rank(engram_server, shard_dirs):
    c = client(engram_server, shard_dirs, rank=0)
    lo, hi = SMALL.rank_rows(1, 0, 2)
    with pytest.raises(ValueError, match="must lie in"):
        c.fetch(1, [hi])
    c.close()


def test_bad_requests_get_errors_and_the_server_keeps_serving(engram_server, shard_dirs):
    conn = Connection(engram_server.address, backend=engram_server.backend)
    region = conn.peer_metadata["shards"][0]["region"]
    dest = np.zeros(264 * 4, np.uint8)
    with pytest.raises(Exception, match="no region"):
        conn.read("engram-l7-r0of2", 0, 264, dest)  # a layer the server does not hold
    if engram_server.backend == "tcp":
        host, port = engram_server.address.rsplit(":", 1)
        raw = socket.create_connection((host, int(port)), timeout=5)
        hello = wire.encode_json({"backend": "tcp"})
        raw.sendall(wire.pack_header(wire.Kind.HELLO, 1, len(hello)) + hello)
        for rows, offset in ((4, 1 << 40), (wire.MAX_GATHER_ROWS + 1, 0)):
            req = wire.READ_HEAD.pack(0, rows, 264) + np.full(rows, offset, "<u8").tobytes()
            raw.sendall(wire.pack_header(wire.Kind.READ, 9, len(req)) + req)
        raw.settimeout(5)
        data = b""
        while data.count(b'"error"') < 2:
            chunk = raw.recv(65536)
            assert chunk
            data += chunk
        assert b"out of range" in data and b"ranges (allowed" in data
        raw.close()
    health = server_health(engram_server.address, engram_server.backend)
    assert health["ok"] and health["backend"] == engram_server.backend
    assert health["resident_bytes"] == sum(conn.regions[name].length for name in conn.regions)
    with pytest.raises(RemoteError, match="expected a JSON object"):
        conn.request(b"garbage")
    conn.read(region, 0, 264 * 4, dest)  # still serving
    conn.close()


def test_qualify_passes_on_the_same_tables_and_fails_on_others(shard_dirs, capsys):
    good = EngramServeProcess(shard_dirs[0], "tcp")
    bad = EngramServeProcess(shard_dirs[1], "tcp")
    try:
        assert cli(["qualify", "--connect", good.address, "--shards", shard_dirs[0],
                    "--backend", "tcp", "--rank", "1", "--all"]) == 0
        assert "qualified" in capsys.readouterr().out
        assert cli(["qualify", "--connect", bad.address, "--shards", shard_dirs[0],
                    "--backend", "tcp", "--rank", "0", "--sample", "500"]) == 1
        out = capsys.readouterr().out
        assert "MISMATCH" in out and "NOT qualified" in out
        # a rank whose shards the folder lacks (a Spark that forgot --rank): nothing compared, not qualified
        assert cli(["qualify", "--connect", good.address, "--shards", shard_dirs[0],
                    "--backend", "tcp", "--rank", "5"]) == 1
        out = capsys.readouterr().out
        assert "no local shard for this link: nothing was compared" in out and "holds no shard of rank 5" in out
        assert "NOT qualified" in out
    finally:
        good.stop()
        bad.stop()
