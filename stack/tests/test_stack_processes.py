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
