"""systemd units (each role's exact command and environment, bounded restarts) and the
watchdog's bounded restarts of a role that runs but does not serve."""

import configparser
import json
import shlex
from pathlib import Path

import pytest
from test_stack_args import filled

from dsv41_stack.cli import main, template_path
from dsv41_stack.config import StackConfig
from dsv41_stack.roles import roles
from dsv41_stack.systemd import RESTART_BURST, SECRETS_FILE, WATCHDOG_MISSES, watchdog


def units(tmp_path) -> dict:
    out = tmp_path / "units"
    assert main(["systemd", "--env", str(template_path("local")), "--out", str(out)]) == 0
    parsed = {}
    for path in out.iterdir():
        p = configparser.ConfigParser(strict=False, interpolation=None)
        p.optionxform = str
        p.read_string(path.read_text().replace("\nEnvironment=", "\nEnvironment_="), source=str(path))
        parsed[path.name] = (p, path.read_text())
    return parsed


def test_each_role_runs_exactly_what_args_prints(tmp_path):
    got = units(tmp_path)
    cfg = StackConfig.load([template_path("local")])
    assert set(got) == {"dsv41-engram-server.service", "dsv41-drafter-worker.service",
                        "dsv41-engine.service", "dsv41-watchdog.service", "dsv41-watchdog.timer"}
    for role in roles(cfg):
        parser, text = got[f"dsv41-{role.name}.service"]
        command = shlex.split(parser["Service"]["ExecStart"])
        assert Path(command[0]).is_absolute() and command[1:] == role.command[1:]
        for key, value in role.env.items():
            assert f'Environment="{key}={value}"' in text
        assert parser["Service"]["Restart"] == "on-failure"
        assert int(parser["Unit"]["StartLimitBurst"]) == RESTART_BURST
    assert got["dsv41-engram-server.service"][0]["Service"]["LimitMEMLOCK"] == "infinity"
    assert "watchdog --env" in got["dsv41-watchdog.service"][0]["Service"]["ExecStart"]


def test_the_watchdog_restarts_a_silent_role_with_a_bound(tmp_path):
    cfg = StackConfig.load([template_path("local")])
    state, clock, restarted = tmp_path / "watchdog.json", [1000.0], []

    def one_pass(engine_serves: bool):
        return watchdog(cfg, None, state, probe=lambda r: r.name != "engine" or engine_serves,
                        restart=restarted.append, now=lambda: clock[0])

    assert one_pass(True) == []
    for _ in range(WATCHDOG_MISSES - 1):  # a miss or two is not yet a restart
        assert "not serving" in one_pass(False)[0] and not restarted
    assert "restarted (1/" in one_pass(False)[0] and restarted == ["dsv41-engine.service"]
    for _ in range((RESTART_BURST - 1) * WATCHDOG_MISSES):
        one_pass(False)
    assert len(restarted) == RESTART_BURST
    for _ in range(WATCHDOG_MISSES):
        said = one_pass(False)
    assert "left down for the operator" in said[0] and len(restarted) == RESTART_BURST
    clock[0] += 3600  # the window has passed: the role still silent is restarted at once
    assert "restarted (1/" in one_pass(False)[0] and len(restarted) == RESTART_BURST + 1
    assert json.loads(state.read_text())["engine"]["misses"] == 0


def test_rank_1s_unit_and_its_watchdog(tmp_path):
    """The second Spark: its own unit running `vllm serve --headless`, and a watchdog that
    leaves it to systemd (it answers nothing; it exits when its group breaks)."""
    env = tmp_path / "two.env"
    env.write_text("STACK_TP=2\nSTACK_ENGINE_NODES=2\nSTACK_ENGINE_MASTER=10.0.0.1:29501\n")
    out = tmp_path / "units"
    assert main(["systemd", "--env", str(env), "--role", "engine", "--rank", "1", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"dsv41-engine-rank1.service", "dsv41-watchdog.service",
                                               "dsv41-watchdog.timer"}
    assert "serve --model" in (out / "dsv41-engine-rank1.service").read_text()
    assert "--role engine --rank 1" in (out / "dsv41-watchdog.service").read_text()
    restarted = []
    said = watchdog(StackConfig.load([env]), "engine", tmp_path / "w.json", restart=restarted.append,
                    rank=1)
    assert said == [] and restarted == []  # serving() on a headless rank: nothing to probe


def test_the_key_file_reaches_every_unit_and_no_secret_is_written(tmp_path):
    """The production template names the key's file: every unit of an ofl server or client
    gets its path, and there is no secret of ours to keep in a 0600 file."""
    out = tmp_path / "units"
    assert main(["systemd", "--env", str(filled(tmp_path, "production-D")), "--out", str(out)]) == 0
    services = {p.name: p.read_text() for p in out.glob("dsv41-*.service") if "watchdog" not in p.name}
    assert set(services) == {"dsv41-engram-server.service", "dsv41-drafter-worker.service",
                             "dsv41-engine.service", "dsv41-engine-rank1.service"}
    path = "/X-path-of-the-key-file-e-g-etc-dsv41-ofl-key"
    for text in services.values():
        assert f'Environment="OFL_AUTH_KEY_FILE={path}"' in text and "EnvironmentFile=" not in text
    assert not (out / SECRETS_FILE).exists()


def test_a_bare_interpreter_name_becomes_the_path_this_shell_finds(tmp_path, monkeypatch):
    """systemd wants an absolute ExecStart: STACK_VLLM_PYTHON=python3 is resolved on PATH
    (not joined to the working folder), and a name PATH lacks is refused."""
    from dsv41_stack.systemd import absolute_executable
    tool = tmp_path / "bin" / "py-for-units"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:/usr/bin")
    assert absolute_executable("py-for-units", "/srv/dsv41") == str(tool)
    assert absolute_executable("venv/bin/python", "/srv/dsv41") == "/srv/dsv41/venv/bin/python"
    assert absolute_executable("/opt/py/bin/python", "/srv/dsv41") == "/opt/py/bin/python"
    with pytest.raises(ValueError, match="no-such-python is not on PATH"):
        absolute_executable("no-such-python", "/srv/dsv41")
