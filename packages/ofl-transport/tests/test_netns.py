"""Loopback integration across two "hosts": network namespaces joined by two veth pairs
(two links, like the two Sparks' links to the offload host), made and removed here.
Needs root and `ip netns`; skipped with the reason where that is not permitted."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

TAG = f"{os.getpid() % 100000}"
HOST_NS, ENGINE_NS = f"oflh{TAG}", f"ofle{TAG}"
LINKS = [("10.231.0.1", "10.231.0.2"), ("10.231.1.1", "10.231.1.2")]  # inside the namespaces only


def sh(*cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60, **kw)


def netns_permitted() -> str | None:
    try:
        sh("ip", "netns", "add", f"oflp{TAG}")
        sh("ip", "netns", "del", f"oflp{TAG}")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns not permitted here ({exc}); runs on a root CI machine"
    return None


reason = netns_permitted()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(reason is not None, reason=reason or "")]


@pytest.fixture
def two_hosts():
    sh("ip", "netns", "add", HOST_NS)
    sh("ip", "netns", "add", ENGINE_NS)
    try:
        for i, (host_ip, engine_ip) in enumerate(LINKS):
            h, e = f"oh{i}{TAG}", f"oe{i}{TAG}"
            sh("ip", "link", "add", h, "type", "veth", "peer", "name", e)
            sh("ip", "link", "set", h, "netns", HOST_NS)
            sh("ip", "link", "set", e, "netns", ENGINE_NS)
            for ns, dev, ip in ((HOST_NS, h, host_ip), (ENGINE_NS, e, engine_ip)):
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "mtu", "9000", "up")
        for ns in (HOST_NS, ENGINE_NS):
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(
            ["ip", "netns", "exec", HOST_NS, sys.executable, "-m", "ofl.cli", "serve",
             "--backend", "tcp", "--size", "16MiB",
             *[a for host_ip, _ in LINKS for a in ("--listen", f"{host_ip}:7471")]],
            stdout=subprocess.PIPE, text=True)
        assert "ofl serve:" in server.stdout.readline()
        yield server
        server.terminate()
        server.wait(timeout=10)
    finally:
        sh("ip", "netns", "del", HOST_NS, check=False)
        sh("ip", "netns", "del", ENGINE_NS, check=False)


def rx_bytes(ns: str, dev: str) -> int:
    return int(sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes")
               .stdout)


def in_engine(code: str) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", ENGINE_NS, sys.executable, "-c", textwrap.dedent(code),
              check=False)


def test_probe_over_two_links(two_hosts):
    before = [rx_bytes(ENGINE_NS, f"oe{i}{TAG}") for i in range(2)]
    res = sh("ip", "netns", "exec", ENGINE_NS, sys.executable, "-m", "ofl.cli", "probe",
             "--backend", "tcp", "--json", "--size", "8MiB", "--reads", "4",
             "--small-reads", "50", "--messages", "50",
             *[a for host_ip, _ in LINKS for a in ("--connect", f"{host_ip}:7471")])
    out = json.loads(res.stdout)["probe"][0]
    assert [r["address"] for r in out["links"]] == [f"{h}:7471" for h, _ in LINKS]
    assert all(r["verified"] and r["gbit_s"] > 0 for r in out["links"])
    assert out["aggregate"]["links"] == 2
    after = [rx_bytes(ENGINE_NS, f"oe{i}{TAG}") for i in range(2)]
    # Each link carried its own reads (verify + 4 reads + aggregate 4 reads of 8 MiB).
    assert all(a - b > 9 * (8 << 20) for a, b in zip(after, before))


def test_one_link_down_other_link_serves(two_hosts):
    sh("ip", "-n", ENGINE_NS, "link", "set", f"oe1{TAG}", "down")
    res = in_engine(f"""
        import numpy as np, time
        from ofl import Links, OflError
        links = Links(["{LINKS[0][0]}:7471"], backend="tcp", connect_timeout_s=1)
        dest = np.zeros(264, np.uint8)
        links.for_rank(0).read("ofl-probe", 0, 264, dest)
        from ofl import Connection
        t = time.monotonic()
        try:
            Connection("{LINKS[1][0]}:7471", backend="tcp", connect_timeout_s=0.5)
            print("UNEXPECTED")
        except OflError as exc:
            print("refused", type(exc).__name__, round(time.monotonic() - t, 2))
        links.for_rank(0).read("ofl-probe", 264, 264, dest)
        print("rank0 ok")
    """)
    assert "rank0 ok" in res.stdout, res.stderr
    kind, seconds = res.stdout.split("refused ")[1].split()[:2]
    assert kind in ("DeadlineExceeded", "ConnectionLost") and float(seconds) < 2
