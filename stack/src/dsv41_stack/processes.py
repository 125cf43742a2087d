"""Start roles as processes with their logs in the run folder, wait until each serves, and
stop every one of them on the way out (also on Ctrl-C or an error)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .roles import Role
from .settings import COMPONENT_PREFIXES


def role_env(role: Role) -> dict[str, str]:
    """This process's environment without the stack's and the components' variables, plus
    the role's: what a role reads of them comes from the env files alone, as `args` shows
    (a variable exported in the launcher's shell would survive a rollback). The legacy
    VLLM_CPU_KVCACHE_SPACE is dropped too (it would override the explicit KV budget)."""
    env = {k: v for k, v in os.environ.items()
           if k != "VLLM_CPU_KVCACHE_SPACE" and not k.startswith(("STACK_", *COMPONENT_PREFIXES))}
    return {**env, **role.env}


# Longer than any role's own bounded shutdown (drafter-tp2's launcher takes up to 35 s).
STOP_TIMEOUT_S = 45.0


class RoleFailed(RuntimeError):
    """A role exited or did not become ready; the message ends with its log's tail."""


class Running:
    def __init__(self, role: Role, proc: subprocess.Popen, log: Path):
        self.role, self.proc, self.log = role, proc, log

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RoleFailed(f"{self.role.name} exited ({self.proc.returncode}):\n{self.tail()}")
        if self.role.ready_line:
            return self.role.ready_line in self.tail(1 << 20)
        try:
            with urllib.request.urlopen(self.role.ready_url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until it served; RoleFailed if it exits or takes longer than timeout_s."""
        t = time.monotonic()
        while not self.ready():
            if time.monotonic() - t > timeout_s:
                raise RoleFailed(f"{self.role.name} not ready in {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.5)
        return time.monotonic() - t

    def address(self) -> str:
        """Where a role that prints 'serve... on ADDRESS' listens (port 0 made concrete)."""
        line = next(x for x in self.tail(1 << 20).splitlines() if self.role.ready_line in x)
        return line.rsplit(" on ", 1)[1].strip()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then after timeout_s SIGKILL to the role's whole process group (it was
        started in a session of its own): a killed supervisor leaves no worker behind."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"dsv41-stack: {self.role.name} did not stop within {timeout_s:.0f} s of "
                      "SIGTERM; killing its process group", file=sys.stderr, flush=True)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Processes:
    """`with Processes(run_dir) as p: p.start(role)` — everything started is stopped."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.running: list[Running] = []

    def start(self, role: Role, label: str = "", timeout_s: float = 900) -> Running:
        log = self.run_dir / "logs" / f"{role.name}{'-' + label if label else ''}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(role.command, stdout=out, stderr=subprocess.STDOUT,
                                    env=role_env(role), start_new_session=True)
        running = Running(role, proc, log)
        self.running.append(running)
        running.wait_ready(timeout_s)
        return running

    def stop(self, running: Running) -> None:
        running.stop()
        self.running.remove(running)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc) -> None:
        for running in reversed(self.running):
            running.stop()
        self.running.clear()
