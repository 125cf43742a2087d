"""systemd units for this machine's roles, and the watchdog that restarts a role which runs
but no longer serves (systemd itself restarts one that exits: Restart=on-failure, bounded by
StartLimitBurst in StartLimitIntervalSec; the watchdog keeps its own bound)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .config import StackConfig
from .roles import Role, roles
from .settings import is_secret

# Secrets (the ofl key) go to this file, mode 0600, which the units name in EnvironmentFile=:
# a unit's Environment= lines are readable by every user (systemctl show).
SECRETS_FILE = "dsv41-secrets.env"
RESTART_BURST, RESTART_WINDOW_S = 3, 600
WATCHDOG_EVERY_S, WATCHDOG_MISSES = 30, 3


def unit_name(role: Role) -> str:
    return f"dsv41-{role.name}.service"


def systemd_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def absolute_executable(program: str, workdir: str) -> str:
    """systemd wants an absolute executable: a bare name as this shell's PATH finds it now
    (the unit's PATH is systemd's own), a relative path from the unit's working folder."""
    if "/" not in program:
        found = shutil.which(program)
        if found is None:
            raise ValueError(f"{program} is not on PATH: give its absolute path (STACK_VLLM_PYTHON "
                             "or the drafter's interpreter) for the units")
        return os.path.abspath(found)
    return str(Path(workdir, program))


def service_unit(role: Role, workdir: str, secrets: Path) -> str:
    env = "\n".join(f"Environment={systemd_quote(f'{k}={v}')}" for k, v in sorted(role.env.items())
                    if not is_secret(k))
    if any(is_secret(k) for k in role.env):
        env += f"\nEnvironmentFile={secrets}"
    command = [absolute_executable(role.command[0], workdir), *role.command[1:]]
    extra = "LimitMEMLOCK=infinity\n" if role.name == "engram-server" else ""
    return f"""[Unit]
Description=DSV41 offload stack: {role.name}
After=network-online.target
Wants=network-online.target
StartLimitIntervalSec={RESTART_WINDOW_S}
StartLimitBurst={RESTART_BURST}

[Service]
Type=simple
WorkingDirectory={workdir}
{env}
ExecStart={shlex.join(command)}
Restart=on-failure
RestartSec=5
KillMode=control-group
TimeoutStopSec=60
{extra}
[Install]
WantedBy=multi-user.target
"""


def watchdog_units(env_files: list[str], role: str | None, workdir: str,
                   rank: int | None = None) -> dict[str, str]:
    args = " ".join(f"--env {shlex.quote(str(Path(f).resolve()))}" for f in env_files)
    args += f" --role {role}" if role else ""
    args += f" --rank {rank}" if rank is not None else ""
    return {
        "dsv41-watchdog.service": f"""[Unit]
Description=DSV41 offload stack: restart a role that runs but does not serve

[Service]
Type=oneshot
WorkingDirectory={workdir}
ExecStart={shlex.quote(sys.executable)} -m dsv41_stack.cli watchdog {args}
""",
        "dsv41-watchdog.timer": f"""[Unit]
Description=DSV41 offload stack watchdog, every {WATCHDOG_EVERY_S} s

[Timer]
OnBootSec=120
OnUnitActiveSec={WATCHDOG_EVERY_S}

[Install]
WantedBy=timers.target
""",
    }


def write_units(cfg: StackConfig, env_files: list[str], role: str | None, out: Path,
                rank: int | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    workdir, secrets = os.getcwd(), (out / SECRETS_FILE).resolve()
    mine = roles(cfg, role, rank)
    files = {unit_name(r): service_unit(r, workdir, secrets) for r in mine}
    files.update(watchdog_units(env_files, role, workdir, rank))
    for name, text in files.items():
        (out / name).write_text(text)
    written = [out / name for name in files]
    if hidden := {k: v for r in mine for k, v in r.env.items() if is_secret(k)}:
        fd = os.open(secrets, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when the file was there before
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in sorted(hidden.items())))
        written.append(secrets)
    return written


def serving(role: Role) -> bool:
    """Does the role answer? The engine on its HTTP readiness URL, the servers on their
    first listener. A headless engine rank answers nothing: it counts as serving (systemd
    restarts it when it exits, which it does when its group breaks; rank 0's probe covers
    the group)."""
    try:
        if role.ready_url:
            with urllib.request.urlopen(role.ready_url, timeout=5) as r:
                return r.status == 200
        if "--listen" not in role.command:
            return True
        host, _, port = role.command[role.command.index("--listen") + 1].rpartition(":")
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def watchdog(cfg: StackConfig, role: str | None, state_path: Path, probe=serving,
             restart=lambda unit: subprocess.run(["systemctl", "restart", unit], check=True),
             now=time.time, rank: int | None = None) -> list[str]:
    """One watchdog pass: a role missing WATCHDOG_MISSES probes in a row is restarted, at
    most RESTART_BURST times per RESTART_WINDOW_S; past that it is left to the operator
    (reported). Returns what it did, one line per role that needed anything."""
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    said = []
    for r in roles(cfg, role, rank):
        entry = state.setdefault(r.name, {"misses": 0, "restarts": []})
        if probe(r):
            entry["misses"] = 0
            continue
        entry["misses"] += 1
        if entry["misses"] < WATCHDOG_MISSES:
            said.append(f"{r.name}: not serving ({entry['misses']}/{WATCHDOG_MISSES})")
            continue
        entry["restarts"] = [t for t in entry["restarts"] if now() - t < RESTART_WINDOW_S]
        if len(entry["restarts"]) >= RESTART_BURST:
            said.append(f"{r.name}: not serving and restarted {RESTART_BURST} times in "
                        f"{RESTART_WINDOW_S} s: left down for the operator")
            continue
        restart(unit_name(r))
        entry["restarts"].append(now())
        entry["misses"] = 0
        said.append(f"{r.name}: restarted ({len(entry['restarts'])}/{RESTART_BURST} in the window)")
    state_path.parent.mkdir(parents=True, exist_ok=True)
    state_path.write_text(json.dumps(state))
    return said
