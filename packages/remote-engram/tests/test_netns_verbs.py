"""The Engram link across hosts: a network-namespace link cut (root; skipped with the
reason elsewhere) and the verbs backend in the soft-RoCE tier."""

import os
import subprocess
import sys

import numpy as np
import pytest

from ofl.testing import TwoHosts, netns_unavailable
from remote_engram.testing import SMALL, EngramServeProcess

NETNS = netns_unavailable()


@pytest.mark.netns
@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_link_cut_falls_back_to_exact_rows(shard_dirs):
    with TwoHosts(links=1) as hosts:
        host_ip = hosts.links[0][0]
        server = hosts.popen_host(
            [sys.executable, "-m", "remote_engram.cli", "serve", "--shards", shard_dirs[0],
             "--backend", "tcp", "--listen", f"{host_ip}:7480"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert "remote-engram serve:" in server.stdout.readline()
            code = f"""
                import numpy as np, subprocess
                from remote_engram.client import EngramClient
                from remote_engram.geometry import EngramGeometry
                g = EngramGeometry(layers=(1, 14), vocab=500, prime_start=1000)
                c = EngramClient(geometry=g, rank=0, shard_dir={shard_dirs[0]!r},
                                 remote="{host_ip}:7480", backend="tcp", deadline_s=0.5,
                                 backoff_s=60)
                lo, hi = g.rank_rows(14, 0, 2)
                ids = np.random.default_rng(0).integers(lo, hi, (32, 12))
                a = c.fetch(14, ids)
                assert c.stats["remote_rows"] > 0
                subprocess.run(["ip", "link", "set", "{hosts.engine_dev[0]}", "down"], check=True)
                b = c.fetch(14, ids + 0)
                local = c.local[14].rows(ids.reshape(-1)).reshape(a.shape)
                print("exact", bool((a == local).all() and (b == local).all()),
                      "fallbacks", c.stats["fallbacks"])
            """
            res = hosts.python_engine(code)
            assert "exact True fallbacks 1" in res.stdout, res.stdout + res.stderr
        finally:
            server.terminate()
            server.wait(timeout=10)


DEVICE = os.environ.get("OFL_TEST_RDMA_DEVICE")


@pytest.mark.softroce
@pytest.mark.skipif(not DEVICE, reason="needs a verbs device: runs in the soft-RoCE tier "
                    "(tools/softroce/verbs-tests.sh, called by tools/test)")
def test_verbs_rows_equal_the_shard(shard_dirs, monkeypatch):
    from remote_engram.client import EngramClient

    monkeypatch.setenv("OFL_IB_DEVICE", DEVICE or "")
    monkeypatch.setenv("OFL_GID_INDEX", os.environ.get("OFL_TEST_RDMA_GID_INDEX", ""))
    monkeypatch.setenv("OFL_MAX_MESSAGE_BYTES", str(1 << 20))
    srv = EngramServeProcess(shard_dirs[0], "verbs")
    try:
        c = EngramClient(geometry=SMALL, rank=1, shard_dir=shard_dirs[0], remote=srv.address,
                         backend="verbs", deadline_s=5)
        for layer in SMALL.layers:
            lo, hi = SMALL.rank_rows(layer, 1, 2)
            ids = np.random.default_rng(layer).integers(lo, hi, (100, 12))
            got = c.fetch(layer, ids)
            assert np.array_equal(got, c.local[layer].rows(ids.reshape(-1)).reshape(got.shape))
        assert c.stats["fallbacks"] == 0 and c.stats["remote_rows"] > 0
        c.close()
    finally:
        srv.stop()
