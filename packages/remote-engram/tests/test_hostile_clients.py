"""A real `remote-engram serve` process with an allow-list, a key and its HTTP endpoint,
against hostile or broken clients: engine ranks that prove the key get exact
rows while the HTTP endpoint is flooded; a rank without the key is refused with the
reason and falls back to its local shard; idle, slow and oversized HTTP clients are capped
and dropped with a bounded thread count and memory; nothing prints a traceback."""

import json
import logging
import socket
import time
import urllib.request

import numpy as np
import pytest
from test_remote import local_rows, random_ids

from ofl import Connection, RemoteError
from ofl.http import read_counters
from ofl.testing import closes, rss_bytes, threads
from remote_engram.cli import main as cli
from remote_engram.client import EngramClient
from remote_engram.testing import SMALL, EngramServeProcess

KEY = "engram-test-key-" * 4
MiB = 1 << 20


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "127.0.0.1:%d" % s.getsockname()[1]


@pytest.fixture
def guarded(shard_dirs, tmp_path):
    """The server with OFL_ALLOW, OFL_AUTH_KEY and a 0.5 s HTTP deadline; its log file."""
    log = tmp_path / "server.log"
    metrics = free_address()
    with open(log, "w") as f:
        srv = EngramServeProcess(shard_dirs[0], "tcp", metrics_listen=metrics, stderr=f,
                                 env={"OFL_ALLOW": "127.0.0.1", "OFL_AUTH_KEY": KEY,
                                      "OFL_HTTP_TIMEOUT_MS": "500"})
    yield srv, metrics, log
    srv.stop()
    text = log.read_text()
    assert "Traceback" not in text, text
    assert KEY not in text


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def test_ranks_with_the_key_are_served_without_it_fall_back(guarded, shard_dirs, monkeypatch,
                                                             caplog, capsys):
    srv, _, _ = guarded
    ids = random_ids(1, 0, (4, 12))
    monkeypatch.setenv("OFL_AUTH_KEY", KEY)
    rank = EngramClient(geometry=SMALL, rank=0, shard_dir=shard_dirs[0], remote=srv.address,
                        backend="tcp", deadline_s=2.0)
    assert np.array_equal(rank.fetch(1, ids), local_rows(shard_dirs[0], 1, 0, ids))
    assert rank.stats["remote_rows"] > 0 and rank.stats["fallbacks"] == 0
    rank.close()
    monkeypatch.delenv("OFL_AUTH_KEY")
    keyless = EngramClient(geometry=SMALL, rank=0, shard_dir=shard_dirs[0], remote=srv.address,
                           backend="tcp", deadline_s=2.0)
    with caplog.at_level(logging.WARNING, "remote_engram.client"):
        assert np.array_equal(keyless.fetch(1, ids), local_rows(shard_dirs[0], 1, 0, ids))
    assert keyless.stats["fallbacks"] == 1 and keyless.stats["remote_rows"] == 0
    assert "set OFL_AUTH_KEY on the client to the server's key" in caplog.text
    keyless.close()
    assert cli(["qualify", "--connect", srv.address, "--shards", shard_dirs[0], "--rank", "0",
                "--backend", "tcp"]) == 1
    assert "set OFL_AUTH_KEY on the client" in capsys.readouterr().err
    with Connection(srv.address, backend="tcp", key=KEY) as conn:  # deep JSON: an error reply
        with pytest.raises(RemoteError, match="expected a JSON object"):
            conn.request(b'{"op":' * 5000 + b"1" + b"}" * 5000)
        assert json.loads(conn.request(b'{"op":"health"}'))["shards"] == 4


def test_the_http_endpoint_is_bounded(guarded):
    """Against the real server: 200 idle connections (a thread each before), a
    1-byte-per-100-ms sender and an incomplete 6 MB request (held in memory before)."""
    srv, metrics, _ = guarded
    assert read_counters(metrics, "engram_server_")["resident_bytes"] > 0
    pid = srv.proc.pid
    base, before = threads(pid), rss_bytes(pid)
    idle = [connect(metrics) for _ in range(200)]
    most = threads(pid)
    t = time.monotonic()  # after the connects: a full listen queue retries one a second later
    assert all(closes(s) for s in idle)  # 503 at once, or 408 at the deadline
    assert most - base <= 8  # OFL_HTTP_MAX_CONNECTIONS request threads at most
    assert time.monotonic() - t < 3
    slow = connect(metrics)
    t = time.monotonic()
    try:
        for byte in b"GET /metrics HTTP/1.1\r\n" * 4:
            slow.send(bytes([byte]))
            time.sleep(0.1)
    except (BrokenPipeError, ConnectionResetError):
        pass  # dropped mid-request
    assert closes(slow) and time.monotonic() - t < 1.5  # the 0.5 s deadline, not 9.2 s
    big = connect(metrics)
    try:
        big.sendall(b"GET /health HTTP/1.1\r\nX: " + b"a" * (6 << 20))
    except (BrokenPipeError, ConnectionResetError):
        pass  # cut off after 8 KiB
    assert closes(big)
    grown = rss_bytes(pid) - before
    assert grown < 8 * MiB, f"RSS grew {grown / MiB:.1f} MiB"
    with urllib.request.urlopen(f"http://{metrics}/health", timeout=5) as r:
        assert json.load(r)["shards"] == 4  # serves again once they are gone
    served = read_counters(metrics, "ofl_http_")
    assert served["busy_refusals"] > 100 and served["oversized_requests"] == 1
    assert served["request_timeouts"] >= 2  # idle ones, and the slow sender
