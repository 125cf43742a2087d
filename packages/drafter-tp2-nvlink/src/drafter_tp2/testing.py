"""Test helpers of drafter-tp2's suite and its CPU benchmark (benchmarks/cpu_check.py): the
pair as real processes on CPU (gloo), with short timeouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

from ofl.testing import ChildProcess

from .launcher import LAUNCHER_GRACE_S

FAST = {"DRAFTER_TP2_TIMEOUT_S": "3", "DRAFTER_TP2_HEARTBEAT_S": "0.3",
        "DRAFTER_TP2_START_TIMEOUT_S": "60", "OMP_NUM_THREADS": "1"}


def worker_args(models, devices="cpu:0,cpu:1", *extra) -> list[str]:
    return ["--drafter", models["dspark"], "--target", models["target"], "--devices", devices,
            "--listen", "127.0.0.1:0", *extra]


def tp2_env(**more) -> dict:
    return {**os.environ, **FAST, **more}


def drafter_tp2(*args, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "drafter_tp2.cli", *args], text=True, **popen)


class PairProcess(ChildProcess):
    """`drafter-tp2 worker` on 127.0.0.1: its address and both ranks' pids once serving.
    stop() gives the launcher the time its own bounded shutdown may take."""

    grace_s = LAUNCHER_GRACE_S

    def __init__(self, args: list[str], env: dict | None = None):
        self.proc = drafter_tp2("worker", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env or tp2_env())
        self.line = self.proc.stdout.readline()
        if " on " not in self.line:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"the pair did not start: {self.line!r} {self.proc.stderr.read()}")
        self.address = self.line.rsplit(" on ", 1)[1].strip()
        pids = self.line.split("rank pids ", 1)[1].split(")", 1)[0]
        self.rank_pids = [int(p) for p in pids.split(",")]


class RankPair:
    """The two ranks started separately (no launcher between them): rank 0's own fault
    handling is what the tests see."""

    def __init__(self, args: list[str], master: str, env: dict | None = None, args1=None):
        env = env or tp2_env()
        # stderr to files: a rank logging many failed rounds must never block on a full pipe
        self.logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
        self.procs = [drafter_tp2("rank", "--rank", str(r), "--master", master,
                                  *(args if r == 0 or args1 is None else args1),
                                  stdout=subprocess.PIPE, stderr=self.logs[r], env=env)
                      for r in range(2)]

    def stderr(self, rank: int) -> str:
        self.logs[rank].seek(0)
        return self.logs[rank].read()

    def ready(self) -> str:
        line = self.procs[0].stdout.readline()
        if " on " not in line:
            raise RuntimeError(f"rank 0 did not serve: {line!r} {self.stderr(0)}")
        return line.rsplit(" on ", 1)[1].strip()

    def wait(self, timeout: float) -> list[tuple[int, str]]:
        out = []
        for r, p in enumerate(self.procs):
            code = p.wait(timeout=timeout)
            out.append((code, self.stderr(r)))
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
