"""The allow-lists and the shared key through the launcher: STACK_ENGINE_HOSTS
becomes the offload host's OFL_ALLOW; preflight checks the key (inline or its file) and the
allow-list, both required once the servers listen where other hosts reach them, that each
engine link is admitted and that the engines' HTTP endpoints admit this host's own reads;
the launcher proves the key to a real keyed Engram server for status and preflight; and the
key is never printed (args, status, preflight) nor written where others can read it
(systemd units, rollback files)."""

import stat
import urllib.error
import urllib.request

import pytest
from test_stack_args import filled

from dsv41_stack import preflight
from dsv41_stack.cli import main, template_path
from dsv41_stack.config import StackConfig
from dsv41_stack.roles import drafter_worker, engine, engram_server
from longctx_bench.launch import free_port
from ofl.http import MetricsServer
from ofl.server import parse_address
from remote_engram.synth import write_shards
from remote_engram.testing import SMALL, EngramServeProcess

KEY = "stack-test-shared-key-" * 3


def env_file(tmp_path, name: str, values: dict) -> str:
    path = tmp_path / f"{name}.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return str(path)


def test_engine_hosts_become_the_offload_hosts_allow_list():
    cfg = StackConfig({"STACK_ENGINE_HOSTS": "10.0.0.2, 10.0.1.0/30", "STACK_ENGRAM_LISTEN":
                       "10.0.0.1:7480,10.0.1.1:7480", "STACK_DRAFTER": "ngram",
                       "STACK_DRAFTER_LISTEN": "0.0.0.0:7490"})
    want = "10.0.0.2,10.0.1.0/30,10.0.0.1,10.0.1.1,127.0.0.1"  # own listeners; 0.0.0.0: loopback
    assert engram_server(cfg).env["OFL_ALLOW"] == drafter_worker(cfg).env["OFL_ALLOW"] == want
    plain = StackConfig({"STACK_ENGRAM_LISTEN": "10.0.0.1:7480", "OFL_ALLOW": "10.0.0.0/24"})
    assert engram_server(plain).env["OFL_ALLOW"] == "10.0.0.0/24"  # the env file's own
    with pytest.raises(ValueError, match="set STACK_ENGINE_HOSTS or OFL_ALLOW, not both"):
        engram_server(plain.with_values(STACK_ENGINE_HOSTS="10.0.0.2"))


def offload_checks(cfg: StackConfig) -> dict:
    return {c.name: c for c in preflight.run(cfg, "offload-host")}


@pytest.fixture
def offload_host(tmp_path) -> StackConfig:
    """An offload host's file with shards, its Engram links on loopback."""
    write_shards(str(tmp_path / "shards"), SMALL, nranks=1)
    return StackConfig({"STACK_ENGRAM_SHARDS": str(tmp_path / "shards"),
                        "STACK_ENGRAM_LISTEN": "127.0.0.1:0", "ENGRAM_BACKEND": "tcp"})


def key_file(tmp_path, mode: int) -> str:
    path = tmp_path / "ofl.key"
    path.write_text(KEY + "\n")
    path.chmod(mode)
    return str(path)


def test_preflight_checks_the_key_and_the_allow_list(offload_host):
    bare = offload_checks(offload_host)  # loopback only: neither is needed
    assert bare["shared key"].ok and not bare["shared key"].warn
    assert bare["allow-list"].ok and not bare["allow-list"].warn
    assert "loopback only" in bare["shared key"].detail + bare["allow-list"].detail
    short = offload_checks(offload_host.with_values(OFL_AUTH_KEY="tooShortKey123",
                                                    STACK_ENGINE_HOSTS="nohost"))
    assert not short["shared key"].ok and "holds 14 characters; use at least 32" in \
        short["shared key"].detail and "tooShortKey123" not in short["shared key"].detail
    assert not short["allow-list"].ok and "'nohost' is neither an address nor a network" in \
        short["allow-list"].detail
    good = offload_checks(offload_host.with_values(OFL_AUTH_KEY=KEY, STACK_ENGINE_HOSTS="10.0.0.2"))
    assert good["shared key"].detail == f"OFL_AUTH_KEY set ({len(KEY)} characters, not shown)"
    assert good["allow-list"].detail == "the servers admit 10.0.0.2,127.0.0.1"
    engine = StackConfig({"STACK_ENGINE_HOSTS": "10.9.9.9",  # an engine host's file
                          "ENGRAM_REMOTE": f"127.0.0.1:{free_port()}"})
    refused = {c.name: c for c in preflight.run(engine, "engine")}["admission engram rank 0"]
    assert not refused.ok and "from 127.0.0.1, which STACK_ENGINE_HOSTS does not list" in \
        refused.detail


def test_production_needs_an_allow_list_and_a_key(offload_host, tmp_path):
    """Servers other hosts can reach (here 0.0.0.0): each of the two missing is a FAIL that
    says what to set; both set pass."""
    exposed = offload_host.with_values(STACK_ENGRAM_LISTEN="0.0.0.0:0")
    bare = offload_checks(exposed)
    assert not bare["allow-list"].ok and "set STACK_ENGINE_HOSTS" in bare["allow-list"].detail
    assert not bare["shared key"].ok and "0.0.0.0:0 can be reached from other hosts" in \
        bare["shared key"].detail and "set OFL_AUTH_KEY_FILE=" in bare["shared key"].detail
    hosts_only = offload_checks(exposed.with_values(STACK_ENGINE_HOSTS="10.0.0.2"))
    assert hosts_only["allow-list"].ok and not hosts_only["shared key"].ok
    both = exposed.with_values(STACK_ENGINE_HOSTS="10.0.0.2",
                               OFL_AUTH_KEY_FILE=key_file(tmp_path, 0o600))
    key_only = offload_checks(both.with_values(STACK_ENGINE_HOSTS=None))
    assert key_only["shared key"].ok and not key_only["allow-list"].ok
    passed = offload_checks(both)
    assert passed["allow-list"].ok and passed["shared key"].ok
    assert passed["shared key"].detail == (f"OFL_AUTH_KEY_FILE {tmp_path}/ofl.key ({len(KEY)} "
                                           "characters, owner-only, not shown)")
    assert KEY not in preflight.report(list(passed.values()))


@pytest.mark.parametrize("role", ["offload-host", "engine"])
def test_a_key_file_others_may_read_or_missing_fails(offload_host, tmp_path, role):
    """On every host: its servers or its clients could not use the key."""
    cfg = offload_host.with_values(STACK_ENGRAM_LISTEN="0.0.0.0:0", STACK_ENGINE_HOSTS="10.0.0.2")
    path = key_file(tmp_path, 0o644)
    readable = {c.name: c for c in preflight.run(cfg.with_values(OFL_AUTH_KEY_FILE=path), role)}
    assert not readable["shared key"].ok
    assert readable["shared key"].detail == (f"OFL_AUTH_KEY_FILE {path} may be read by others "
                                             f"(mode 0644): chmod 600 {path}")
    missing = str(tmp_path / "none.key")
    gone = {c.name: c for c in preflight.run(cfg.with_values(OFL_AUTH_KEY_FILE=missing), role)}
    assert not gone["shared key"].ok and gone["shared key"].detail.startswith(
        f"OFL_AUTH_KEY_FILE {missing} does not exist: create it once with `openssl rand -hex 32 "
        f"> {missing} && chmod 600 {missing}`")
    both = {c.name: c for c in preflight.run(cfg.with_values(
        OFL_AUTH_KEY_FILE=key_file(tmp_path, 0o600), OFL_AUTH_KEY=KEY), role)}
    assert not both["shared key"].ok and "set one" in both["shared key"].detail
    assert KEY not in "".join(c.detail for c in [*readable.values(), *gone.values(), *both.values()])


def test_the_local_template_passes_on_loopback():
    checks = {c.name: c for c in preflight.run(StackConfig.load([template_path("local")]),
                                               "offload-host")}
    assert checks["shared key"].ok and not checks["shared key"].warn
    assert checks["allow-list"].detail == "the servers admit 127.0.0.1"


def test_the_engines_endpoints_admit_this_hosts_reads():
    """With OFL_ALLOW given to the engines, their HTTP endpoints answer only those peers, and
    status and the canary read them from this host: preflight says when that is refused,
    and the endpoint indeed answers 403."""
    listen = f"127.0.0.1:{free_port()}"
    cfg = StackConfig({"OFL_ALLOW": "10.0.0.0/24", "ASYNC_HANDOFF_METRICS_LISTEN": listen})
    refused = {c.name: c for c in preflight.run(cfg, "engine")}["admission of this host's reads"]
    assert not refused.ok and refused.detail.startswith("OFL_ALLOW refuses 127.0.0.1")
    for allow, status in (("10.0.0.0/24", 403), ("10.0.0.0/24,127.0.0.1", 200)):
        role = engine(cfg.with_values(OFL_ALLOW=allow))
        endpoint = MetricsServer(*parse_address(role.env["ASYNC_HANDOFF_METRICS_LISTEN"]),
                                 lambda: "", allow=role.env["OFL_ALLOW"])
        try:
            assert http_status(f"http://{listen}/metrics") == status
        finally:
            endpoint.shutdown()
            endpoint.server_close()
    admitted = {c.name: c for c in preflight.run(cfg.with_values(
        OFL_ALLOW="10.0.0.0/24,127.0.0.1"), "engine")}["admission of this host's reads"]
    assert admitted.ok


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_launcher_proves_the_key_and_never_prints_it(tmp_path, capsys):
    shards = tmp_path / "shards"
    write_shards(str(shards), SMALL, nranks=1)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    port = free_port()
    srv = EngramServeProcess(str(shards), "tcp", port=port, env={"OFL_AUTH_KEY": KEY})
    try:
        (tmp_path / "pids").mkdir()
        (tmp_path / "pids" / "engram-server.pid").write_text(str(srv.proc.pid))
        values = {"STACK_RUN_DIR": tmp_path, "STACK_MODEL": tmp_path / "model",
                  "STACK_ENGRAM_SHARDS": shards, "STACK_ENGRAM_LISTEN": f"127.0.0.1:{port}",
                  "ENGRAM_BACKEND": "tcp", "ENGRAM_REMOTE": f"127.0.0.1:{port}",
                  "ENGRAM_SHARD_DIR": shards, "STACK_ENGINE_HOSTS": "127.0.0.1"}
        keyed = env_file(tmp_path, "keyed", {**values, "OFL_AUTH_KEY": KEY})
        assert main(["status", "--env", keyed, "--role", "engram-server"]) == 0
        assert '"shards": 2' in (out := capsys.readouterr().out)
        assert '"exposure": "loopback"' in out and '"key": true' in out  # how its link admits
        main(["preflight", "--env", keyed, "--role", "engine"])
        out += capsys.readouterr().out
        assert "PASS  qualify rank 0" in out and "PASS  admission engram rank 0" in out
        assert main(["args", "--env", keyed]) == 0
        out += capsys.readouterr().out
        assert "OFL_AUTH_KEY=REDACTED" in out and "OFL_ALLOW=127.0.0.1\n" in out
        assert KEY not in out
        keyless = env_file(tmp_path, "keyless", values)
        main(["status", "--env", keyless, "--role", "engram-server"])
        assert "AuthenticationFailed" in (out := capsys.readouterr().out)
        assert "set OFL_AUTH_KEY on the client to the server's key" in out
        assert main(["preflight", "--env", keyless, "--role", "engine"]) == 1
        assert "FAIL  qualify rank 0" in capsys.readouterr().out
    finally:
        srv.stop()


def test_the_key_stays_out_of_units_and_readable_files(tmp_path, capsys):
    files = ["--env", str(filled(tmp_path, "production-D")),  # the key inline, not its file
             "--env", env_file(tmp_path, "key", {"OFL_AUTH_KEY_FILE": "", "OFL_AUTH_KEY": KEY})]
    out = tmp_path / "units"
    assert main(["systemd", *files, "--out", str(out)]) == 0
    assert "the units read OFL_AUTH_KEY from" in capsys.readouterr().out
    secrets = out / "dsv41-secrets.env"
    assert secrets.read_text() == f"OFL_AUTH_KEY={KEY}\n"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    for unit in out.glob("dsv41-*.service"):
        text = unit.read_text()
        assert KEY not in text
        if "watchdog" not in unit.name:
            assert f"EnvironmentFile={secrets.resolve()}" in text
    rolled = tmp_path / "rolled.env"
    assert main(["rollback", "remote-engram", *files, "--write", str(rolled)]) == 0
    assert KEY in rolled.read_text() and stat.S_IMODE(rolled.stat().st_mode) == 0o600
