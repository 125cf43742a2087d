"""Several offload hosts behind one rank (real server processes over tcp loopback, CPU
only): reads spread over them, a killed host fails over to another (no fallback while one
lives), the local shard serves only when none answers, a host that comes back is readmitted
only once its rows equal the local shard's, and a host with other tables is quarantined."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_remote import local_rows, random_ids

from ofl import Connection
from ofl.testing import TwoHosts, netns_unavailable, stop_process, wait_until
from remote_engram import env
from remote_engram.client import EngramClient, EngramUnavailable
from remote_engram.testing import SMALL, EngramServeProcess


def hosts_client(servers, shard_dir, **kw):
    return EngramClient(geometry=SMALL, rank=0, shard_dir=shard_dir,
                        remote=[s.address for s in servers], backend="tcp",
                        deadline_s=kw.pop("deadline_s", 2.0), backoff_s=kw.pop("backoff_s", 0.1), **kw)


def states(c):
    return [h["state"] for h in c.host_status()]


def read_exactly(c, shard_dir, seed):
    layer = SMALL.layers[seed % 2]
    ids = random_ids(layer, 0, (16, 12), seed=seed)
    assert np.array_equal(c.fetch(layer, ids), local_rows(shard_dir, layer, 0, ids))


def read_until(c, shard_dir, observed, what):
    """Exact reads, one after another, until `observed()` holds (the event a drill waits on)."""
    seeds = iter(range(100, 10_000))
    wait_until(lambda: read_exactly(c, shard_dir, next(seeds)) or observed(), what=what,
               timeout_s=30, interval_s=0)


@pytest.fixture
def three(shard_dirs):
    servers = [EngramServeProcess(shard_dirs[0], "tcp") for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


def test_reads_spread_over_every_healthy_host(three, shard_dirs):
    c = hosts_client(three, shard_dirs[0])
    try:
        for seed in range(9):
            read_exactly(c, shard_dirs[0], seed)
        assert all(h["rows"] > 0 for h in c.host_status()), c.host_status()
        assert c.stats["fallbacks"] == c.stats["failovers"] == 0
        assert c.stats["remote_rows"] == c.stats["unique_rows"]
    finally:
        c.close()


def test_a_killed_host_fails_over_then_falls_back_only_when_none_lives(three, shard_dirs):
    c = hosts_client(three, shard_dirs[0], backoff_s=60)  # no readmission in this drill
    try:
        for seed in range(3):
            read_exactly(c, shard_dirs[0], seed)
        for dead, server in enumerate(three[:2]):
            server.proc.kill()
            server.proc.wait()
            # every read still remote: the dead host's turn fails over to a live one
            read_until(c, shard_dirs[0], lambda dead=dead: c.stats["failovers"] > dead,
                       f"a failover away from host {dead}")
            assert c.stats["fallbacks"] == 0 and c.stats["local_rows"] == 0
            assert states(c)[dead] == "failed" and c.host_status()[dead]["reason"], c.host_status()
        three[2].proc.kill()
        three[2].proc.wait()
        read_exactly(c, shard_dirs[0], 20)  # the local shard, the same bytes
        assert c.stats["fallbacks"] == 1 and c.stats["local_rows"] > 0
        assert states(c) == ["failed"] * 3
        read_exactly(c, shard_dirs[0], 21)  # none healthy: local without trying a link
        assert c.stats["backoff_skips"] == 1 and c.stats["fallbacks"] == 1
    finally:
        c.close()


def test_a_frozen_host_fails_over_within_one_deadline(shard_dirs):
    first, second = EngramServeProcess(shard_dirs[0], "tcp"), EngramServeProcess(shard_dirs[0], "tcp")
    c = hosts_client([first, second], shard_dirs[0], deadline_s=1.0, backoff_s=60)
    try:
        read_until(c, shard_dirs[0], lambda: all(h["rows"] for h in c.host_status()), "both hosts read")
        stop_process(first.proc.pid)  # answers nothing from here on
        took = []

        def timed_read():
            started = time.monotonic()
            read_exactly(c, shard_dirs[0], len(took))
            took.append(time.monotonic() - started)
        wait_until(lambda: timed_read() or c.stats["failovers"], what="a read failed over",
                   timeout_s=30, interval_s=0)
        assert max(took) < 1.0 + 0.5, took  # within the read's deadline (and a loaded machine's slack)
        assert c.stats["fallbacks"] == 0 and states(c) == ["failed", "healthy"]
        assert "DeadlineExceeded" in c.host_status()[0]["reason"], c.host_status()
    finally:
        c.close()
        first.proc.send_signal(signal.SIGCONT)
        first.stop()
        second.stop()


def test_a_host_that_comes_back_is_readmitted_once_its_rows_qualify(shard_dirs):
    first, second = EngramServeProcess(shard_dirs[0], "tcp"), EngramServeProcess(shard_dirs[0], "tcp")
    c = hosts_client([first, second], shard_dirs[0], backoff_s=0.05)
    back = None
    try:
        read_exactly(c, shard_dirs[0], 0)
        read_exactly(c, shard_dirs[0], 1)
        first.proc.kill()
        first.proc.wait()
        read_until(c, shard_dirs[0], lambda: states(c)[0] == "failed", "host 0 set aside")
        back = EngramServeProcess(shard_dirs[0], "tcp", port=first.port)
        wait_until(lambda: c.stats["readmissions"], what="host 0 readmitted", timeout_s=30)
        status = c.host_status()[0]
        assert status["state"] == "healthy" and "rows equal the local shards" in status["reason"]
        served = status["rows"]
        read_until(c, shard_dirs[0], lambda: c.host_status()[0]["rows"] > served,
                   "rows read from the readmitted host")
        assert c.stats["fallbacks"] == 0
    finally:
        c.close()
        for s in (first, second, back):
            if s is not None:
                s.stop()


def test_a_host_with_other_tables_is_quarantined_and_never_read(shard_dirs):
    good, other = EngramServeProcess(shard_dirs[0], "tcp"), EngramServeProcess(shard_dirs[1], "tcp")
    c = hosts_client([other, good], shard_dirs[0])
    try:
        for seed in range(6):
            read_exactly(c, shard_dirs[0], seed)
        status = c.host_status()
        assert status[0]["state"] == "quarantined" and "digest" in status[0]["reason"], status
        assert status[0]["rows"] == 0 and status[1]["rows"] > 0
        assert c.stats["quarantines"] == 1 and c.stats["fallbacks"] == 0
        text = c.prometheus()  # the states as gauges beside the counters
        assert f'host="{other.address}",state="quarantined"}} 0' in text, text
        assert f'host="{good.address}",state="healthy"}} 1' in text, text
        assert "engram_client_quarantines_total" in text
    finally:
        c.close()
        good.stop()
        other.stop()


def test_the_readmission_check_finds_rows_that_differ(shard_dirs):
    """The bitwise sample itself, against a server whose rows are another table's."""
    good, other = EngramServeProcess(shard_dirs[0], "tcp"), EngramServeProcess(shard_dirs[1], "tcp")
    c = hosts_client([good], shard_dirs[0])
    conn = Connection(other.address, backend="tcp")
    try:
        served = {s["layer"]: s["region"] for s in conn.peer_metadata["shards"]
                  if (s["lo"], s["hi"]) == c.ranges[s["layer"]]}
        why = c.hosts._rows_differ(conn, served)
        assert why.startswith(f"layer {SMALL.layers[0]}: ") and "sampled rows differ" in why, why
        own = Connection(good.address, backend="tcp")
        assert c.hosts._rows_differ(own, {s["layer"]: s["region"] for s in own.peer_metadata["shards"]
                                          if (s["lo"], s["hi"]) == c.ranges[s["layer"]]}) == ""
        own.close()
    finally:
        conn.close()
        c.close()
        good.stop()
        other.stop()


def test_hosts_come_from_the_environment_per_rank():
    assert env.hosts_for_rank(1, "", "a:1,a:2; b:1,b:2") == ["a:2", "b:2"]
    assert env.hosts_for_rank(0, "a:1", "") == ["a:1"]
    assert env.hosts_for_rank(0, "", "") == []
    with pytest.raises(ValueError, match="both ENGRAM_REMOTE and ENGRAM_HOSTS"):
        env.hosts_for_rank(0, "a:1", "b:1")


def test_no_host_and_no_local_shard_says_which_hosts_failed(shard_dirs):
    srv = EngramServeProcess(shard_dirs[0], "tcp")
    c = EngramClient(geometry=SMALL, rank=0, remote=[srv.address], backend="tcp", deadline_s=1.0,
                     backoff_s=60)
    try:
        ids = random_ids(1, 0, (4, 12))
        assert np.array_equal(c.fetch(1, ids), local_rows(shard_dirs[0], 1, 0, ids))
        srv.proc.kill()
        srv.proc.wait()
        with pytest.raises(EngramUnavailable, match="no offload host answered.*'failed'"):
            c.fetch(1, random_ids(1, 0, (4, 12), seed=5))
    finally:
        c.close()
        srv.stop()



NETNS = netns_unavailable()


@pytest.mark.netns
@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_two_hosts_across_network_namespaces_a_link_cut_then_back(shard_dirs):
    """Two offload hosts, each behind its own veth link from the engine's namespace: one
    link cut mid-session fails over (no fallback), both cut fall back, the first link back
    is readmitted once its rows qualify; rows exact throughout."""
    with TwoHosts(links=2) as net:
        servers = [net.popen_host([sys.executable, "-m", "remote_engram.cli", "serve", "--shards",
                                   shard_dirs[0], "--backend", "tcp", "--listen", f"{host_ip}:7480"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                   for host_ip, _ in net.links]
        try:
            for s in servers:
                assert "remote-engram serve:" in s.stdout.readline()
            hosts = [f"{host_ip}:7480" for host_ip, _ in net.links]
            code = f"""
                import subprocess, time
                import numpy as np
                from remote_engram.client import EngramClient
                from remote_engram.testing import SMALL
                c = EngramClient(geometry=SMALL, rank=0, shard_dir={shard_dirs[0]!r}, remote={hosts!r},
                                 backend="tcp", deadline_s=0.6, backoff_s=0.1)
                rng = np.random.default_rng(0)
                lo, hi = SMALL.rank_rows(14, 0, 2)
                def exact():
                    ids = rng.integers(lo, hi, (32, 12))
                    return bool((c.fetch(14, ids) == c.local[14].rows(ids.reshape(-1)).reshape(32, 12, 264)).all())
                def link(i, state):
                    subprocess.run(["ip", "link", "set", {net.engine_dev!r}[i], state], check=True)
                ok = all(exact() for _ in range(4))
                link(0, "down")
                ok &= all(exact() for _ in range(4))
                one_cut = (c.stats["failovers"], c.stats["fallbacks"], [h["state"] for h in c.host_status()])
                link(1, "down")
                ok &= exact()
                both_cut = c.stats["fallbacks"]
                link(0, "up")
                end = time.monotonic() + 60
                while not c.stats["readmissions"] and time.monotonic() < end:
                    ok &= exact()  # the local shards serve meanwhile
                    time.sleep(0.05)
                remote = c.stats["remote_rows"]
                ok &= exact()
                print("exact", ok, "one_cut", one_cut, "both_cut", both_cut, "readmitted",
                      c.stats["readmissions"], [h["state"] for h in c.host_status()],
                      "remote_again", c.stats["remote_rows"] > remote)
                c.close()
            """
            res = net.python_engine(code)
            out = res.stdout + res.stderr
            assert "exact True" in out, out
            assert "one_cut (1, 0, ['failed', 'healthy'])" in out, out
            assert "both_cut 1" in out and "readmitted 1 ['healthy', 'failed'] remote_again True" in out, out
        finally:
            for s in servers:
                s.terminate()
                s.wait(timeout=10)
