"""Loopback integration across two "hosts": network namespaces joined by two veth pairs
(two links, like the two Sparks' links to the offload host), made and removed here.
Needs root and `ip netns`; skipped with the reason where that is not permitted."""

import json
import sys

import pytest

from ofl.testing import TwoHosts, netns_unavailable

reason = netns_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(reason is not None, reason=reason or "")]


@pytest.fixture
def hosts():
    with TwoHosts(links=2) as h:
        server = h.popen_host(
            [sys.executable, "-m", "ofl.cli", "serve", "--backend", "tcp", "--size", "16MiB",
             *[a for host_ip, _ in h.links for a in ("--listen", f"{host_ip}:7471")]],
            stdout=__import__("subprocess").PIPE, text=True)
        assert "ofl serve:" in server.stdout.readline()
        yield h
        server.terminate()
        server.wait(timeout=10)


def test_probe_over_two_links(hosts):
    before = [hosts.rx_bytes(i) for i in range(2)]
    res = hosts.run_engine(
        [sys.executable, "-m", "ofl.cli", "probe", "--backend", "tcp", "--json", "--size", "8MiB",
         "--reads", "4", "--small-reads", "50", "--messages", "50",
         *[a for host_ip, _ in hosts.links for a in ("--connect", f"{host_ip}:7471")]], check=True)
    out = json.loads(res.stdout)["probe"][0]
    assert [r["address"] for r in out["links"]] == [f"{h}:7471" for h, _ in hosts.links]
    assert all(r["gbit_s"] > 0 for r in out["links"])  # (a wrong byte fails the probe)
    assert out["aggregate"]["links"] == 2
    after = [hosts.rx_bytes(i) for i in range(2)]
    # Each link carried its own reads (verify + 4 reads + aggregate 4 reads of 8 MiB).
    assert all(a - b > 9 * (8 << 20) for a, b in zip(after, before))


def test_one_link_down_other_link_serves(hosts):
    hosts.set_link(1, up=False)
    res = hosts.python_engine(f"""
        import numpy as np, time
        from ofl import Connection, Links, OflError
        links = Links(["{hosts.links[0][0]}:7471"], backend="tcp", connect_timeout_s=1)
        dest = np.zeros(264, np.uint8)
        links.for_rank(0).read("ofl-probe", 0, 264, dest)
        t = time.monotonic()
        try:
            Connection("{hosts.links[1][0]}:7471", backend="tcp", connect_timeout_s=0.5)
            print("UNEXPECTED")
        except OflError as exc:
            print("refused", type(exc).__name__, round(time.monotonic() - t, 2))
        links.for_rank(0).read("ofl-probe", 264, 264, dest)
        print("rank0 ok")
    """)
    assert "rank0 ok" in res.stdout, res.stderr
    kind, seconds = res.stdout.split("refused ")[1].split()[:2]
    assert kind in ("DeadlineExceeded", "ConnectionLost") and float(seconds) < 2
