"""The allow-lists and the shared key through the launcher: STACK_ENGINE_HOSTS
becomes the offload host's OFL_ALLOW; preflight checks the key and the allow-list on the
offload host and that each engine link is admitted; the launcher proves the key to a real
keyed Engram server for status and preflight; and the key is never printed (args, status,
preflight) nor written where others can read it (systemd units, rollback files)."""

import socket
import stat

import pytest
from test_stack_args import filled

from dsv41_stack import preflight
from dsv41_stack.cli import main
from dsv41_stack.config import StackConfig
from dsv41_stack.roles import drafter_worker, engram_server
from remote_engram.synth import write_shards
from remote_engram.testing import SMALL, EngramServeProcess

KEY = "stack-test-shared-key-" * 3


def env_file(tmp_path, name: str, values: dict) -> str:
    path = tmp_path / f"{name}.env"
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_preflight_checks_the_key_and_the_allow_list(tmp_path):
    write_shards(str(tmp_path / "shards"), SMALL, nranks=1)
    host = StackConfig({"STACK_ENGRAM_SHARDS": str(tmp_path / "shards"),
                        "STACK_ENGRAM_LISTEN": "127.0.0.1:0", "ENGRAM_BACKEND": "tcp"})

    def checks(cfg, role="offload-host"):
        return {c.name: c for c in preflight.run(cfg, role)}

    bare = checks(host)
    assert bare["shared key"].warn and bare["allow-list"].warn  # passes, with a warning each
    short = checks(host.with_values(OFL_AUTH_KEY="tooShortKey123", STACK_ENGINE_HOSTS="nohost"))
    assert not short["shared key"].ok and "holds 14 characters; use at least 32" in \
        short["shared key"].detail and "tooShortKey123" not in short["shared key"].detail
    assert not short["allow-list"].ok and "'nohost' is neither an address nor a network" in \
        short["allow-list"].detail
    good = checks(host.with_values(OFL_AUTH_KEY=KEY, STACK_ENGINE_HOSTS="10.0.0.2"))
    assert good["shared key"].detail == f"OFL_AUTH_KEY set ({len(KEY)} characters, not shown)"
    assert good["allow-list"].detail == "the servers admit 10.0.0.2,127.0.0.1"
    engine = StackConfig({"STACK_ENGINE_HOSTS": "10.9.9.9",  # an engine host's file
                          "ENGRAM_REMOTE": f"127.0.0.1:{free_port()}"})
    refused = checks(engine, "engine")["admission engram rank 0"]
    assert not refused.ok and "from 127.0.0.1, which STACK_ENGINE_HOSTS does not list" in \
        refused.detail


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
    files = ["--env", str(filled(tmp_path, "production-D")),
             "--env", env_file(tmp_path, "key", {"OFL_AUTH_KEY": KEY})]
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
