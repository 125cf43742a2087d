"""`drafter-tp2 supervise`: keep a pair running, restarting it when it stops serving, at
most `restarts` times within `window_s`; then give up with a clear message (clients keep
decoding target-only, which is always correct). A pair that refused to start (exit 2:
pair safety, a held device lock, bad arguments) is not restarted: it would refuse again."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque

from .launcher import LAUNCHER_GRACE_S, stop_process

ROLLBACK = "roll back to the one-card worker: README, 'Rollback'"


def supervise(command: list[str], restarts: int, window_s: float, backoff_s: float = 1.0,
              say=lambda text: print(text, file=sys.stderr, flush=True)) -> int:
    """Run `command` (a `drafter-tp2 worker ...` process) until it exits 0 or the bound is
    spent; returns the exit code for the supervisor."""
    history: deque[float] = deque()
    term = []
    signal.signal(signal.SIGTERM, lambda *a: term.append(1))
    signal.signal(signal.SIGINT, lambda *a: term.append(1))
    while True:
        proc = subprocess.Popen(command, stdout=sys.stdout)
        while proc.poll() is None and not term:
            time.sleep(0.1)
        if term:
            stop_process(proc, "the pair's launcher", LAUNCHER_GRACE_S)
            return 0
        code = proc.returncode
        if code == 0:
            return 0
        if code == 2:
            say("drafter-tp2 supervise: the pair refused to start (its reason is above); "
                f"not restarting; {ROLLBACK}")
            return 2
        now = time.monotonic()
        while history and now - history[0] > window_s:
            history.popleft()
        if len(history) >= restarts:
            say(f"drafter-tp2 supervise: gave up: the pair stopped {len(history) + 1} times within "
                f"{window_s:g} s (bound: {restarts} restarts); last exit {code}; clients decode "
                f"target-only; {ROLLBACK}")
            return 1
        history.append(now)
        say(f"drafter-tp2 supervise: the pair stopped (exit {code}); restart {len(history)} of "
            f"{restarts} within {window_s:g} s")
        time.sleep(backoff_s)
