"""Roles as processes (CPU, no services): a role that ignores SIGTERM is killed with its whole
process group, so a supervisor killed past its grace leaves no worker behind."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from dsv41_stack.processes import Processes
from dsv41_stack.roles import Role

# A supervisor that ignores SIGTERM, and a worker under it that ignores it too.
STUBBORN = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(f"stubborn ready {child.pid}", flush=True)
child.wait()
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a killed orphan may stay a zombie until init reaps it


def test_a_role_that_ignores_sigterm_is_killed_with_its_children(tmp_path):
    role = Role("stubborn", [sys.executable, "-c", STUBBORN], ready_line="stubborn ready")
    with Processes(tmp_path) as processes:
        running = processes.start(role, timeout_s=60)
        child = int(running.tail().split("stubborn ready ", 1)[1].split()[0])
        assert alive(child)
        running.stop(timeout_s=0.5)
        assert running.proc.returncode == -9
        deadline = time.monotonic() + 30
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the role's child outlived it"


def test_a_role_reads_component_variables_from_its_env_files_alone(monkeypatch):
    """A variable exported in the launcher's shell (left from an earlier deployment) must not
    reach a role behind the env files' back: `args` and the rollbacks show what runs."""
    from dsv41_stack.processes import role_env
    monkeypatch.setenv("ENGRAM_REMOTE", "10.0.0.9:7480")
    monkeypatch.setenv("VLLM_DSPARK_REMOTE_ASYNC", "1")
    monkeypatch.setenv("STACK_TP", "2")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "kept")
    env = role_env(Role("engine", ["true"], {"OFL_BACKEND": "tcp"}))
    assert env["OFL_BACKEND"] == "tcp" and env["HOME_OF_SOMETHING_ELSE"] == "kept"
    assert not {"ENGRAM_REMOTE", "VLLM_DSPARK_REMOTE_ASYNC", "STACK_TP", "VLLM_CPU_KVCACHE_SPACE"} & set(env)
