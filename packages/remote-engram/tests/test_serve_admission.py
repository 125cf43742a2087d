"""`remote-engram serve` is closed by default: on an address other hosts can reach it needs an
allow-list or a key, else it exits with one line saying what to set; `--insecure` admits
every peer anyway, with a warning, and health says so for each link."""

import socket
import subprocess
import sys

import pytest

from ofl import ConfigurationError
from remote_engram.cli import shard_paths
from remote_engram.client import server_health
from remote_engram.server import EngramServer
from remote_engram.testing import EngramServeProcess

ADMISSION = ("OFL_ALLOW", "OFL_AUTH_KEY", "OFL_AUTH_KEY_FILE", "OFL_INSECURE")


@pytest.fixture
def no_admission(monkeypatch):
    """Neither an allow-list, nor a key, nor the insecure switch in the environment."""
    for name in ADMISSION:
        monkeypatch.delenv(name, raising=False)


def serve(shard_dir: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote_engram.cli", "serve", "--shards",
                           shard_dir, "--backend", "tcp", *flags],
                          capture_output=True, text=True, timeout=60)


def test_a_reachable_address_without_admission_exits_with_one_line(shard_dirs, no_admission):
    done = serve(shard_dirs[0], "--listen", "0.0.0.0:0")
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" not in done.stderr
    # refused before the tables load: no progress bars, the reason alone
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "remote-engram serve: refusing to listen on 0.0.0.0, an address other hosts can reach")
    assert all(what in done.stderr for what in ("OFL_ALLOW", "OFL_AUTH_KEY_FILE", "--insecure"))


def test_insecure_starts_warns_and_health_says_so(shard_dirs, no_admission, tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        srv = EngramServeProcess(shard_dirs[0], "tcp", host="0.0.0.0", flags=("--insecure",),
                                 stderr=f)
    try:
        port = srv.port
        health = server_health(f"127.0.0.1:{port}", "tcp")
    finally:
        srv.stop()
    assert health["admission"] == {f"0.0.0.0:{port}": {
        "exposure": "insecure", "allow": [], "key": False, "idle_timeout_s": 300.0}}
    assert "admits any peer with no proof" in log.read_text()


def test_health_shows_each_links_admission(shard_dirs, no_admission, monkeypatch):
    monkeypatch.setenv("OFL_ALLOW", "10.0.0.2")
    server = EngramServer(shard_paths(shard_dirs[0]), backend="tcp",
                          listen=["127.0.0.1:0", "0.0.0.0:0"], mlock=False)
    try:
        loopback, wildcard = (server.health()["admission"][a] for a in server.health()["links"])
    finally:
        server.stop()
    assert loopback["exposure"] == "loopback"
    assert wildcard["exposure"] == "allow-list" and wildcard["allow"] == ["10.0.0.2/32"]


def test_a_refused_link_frees_the_links_opened_before_it(shard_dirs, no_admission):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigurationError, match="refusing to listen on 0.0.0.0"):
        EngramServer(shard_paths(shard_dirs[0]), backend="tcp",
                     listen=[f"127.0.0.1:{port}", "0.0.0.0:0"], mlock=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # the first link's listener is closed again
