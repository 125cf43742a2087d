"""What a failed drafter worker costs a pool (REMOTE_DRAFTER_STANDBYS), on one machine:
two n-gram workers over tcp loopback, one client as the engine's, one request of a
repetitive prompt, one round per simulated step (`--step-ms` of engine work between
rounds). The primary is killed (SIGKILL) or frozen (SIGSTOP) once it has answered
`--before` rounds (an observed event); per path (sync rounds, rounds through the proxy) and
fault: the steps without drafts until the standby drafts, the time from the fault to that
step, and the round p50 before and after.

    python packages/remote-drafter/benchmarks/pool.py --out findings/raw/drafter-pool-<date>.json
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np

from async_handoff import HandoffConfig
from ofl.cli import emit_result
from ofl.testing import stop_process
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.transport import AsyncTransport, RemoteTransport
from remote_drafter.models.llama import random_llama
from remote_drafter.testing import TINY, WorkerProcess

PATTERN = np.array([5, 6, 7, 8, 9], np.int32)


def work(ms: float) -> None:
    """The engine's own share of a step (busy, as a step is)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def one_drill(target: str, path: str, fault: str, args) -> dict:
    workers = [WorkerProcess("ngram", target) for _ in range(2)]
    expect = expectation(target, None)
    if path == "sync":
        transport = RemoteTransport(workers[0].address, "tcp", expect, retry_s=0.01,
                                    standbys=(workers[1].address,))
    else:
        config = HandoffConfig(round_deadline_ms=args.deadline_ms, max_wait_ms=args.deadline_ms)
        transport = AsyncTransport(workers[0].address, "tcp", expect, config,
                                   standbys=(workers[1].address,))
    client = DrafterClient(transport, "8:3", deadline_s=args.deadline_ms / 1000)
    client.add_request(1, np.tile(PATTERN, 6))
    steps = []  # (seconds of the step's drafting, drafted?, when it ended)
    faulted_at = None
    try:
        for i in range(args.before + args.after):
            started = time.perf_counter()
            if path == "sync":
                drafts = client.propose(3)
            else:
                client.submit(3)
                work(args.step_ms)
                drafts = client.collect()
            took = time.perf_counter() - started
            if path == "sync":
                work(args.step_ms)
            steps.append((took, 1 in drafts, time.perf_counter()))
            client.commit(1, PATTERN[i % 5:i % 5 + 1])
            if faulted_at is None and client.counters()["rounds_ok"] >= args.before:
                if fault == "freeze":
                    stop_process(workers[0].proc.pid)
                else:
                    os.kill(workers[0].proc.pid, signal.SIGKILL)
                faulted_at = time.perf_counter()
                fault_step = len(steps)
        after = steps[fault_step:]
        resumed = next((j for j, (_, drafted, _) in enumerate(after) if drafted), None)
        before = [s[0] for s in steps[:fault_step] if s[1]]
        return {"steps_without_drafts": resumed if resumed is not None else len(after),
                # from the fault to the end of the first step the standby drafted for
                "ms_to_drafts_again": None if resumed is None else round(1e3 * (after[resumed][2] - faulted_at), 1),
                "round_p50_ms_before": round(1e3 * float(np.median(before)), 3),
                "round_p50_ms_on_the_standby": round(1e3 * float(np.median(
                    [s[0] for s in after[(resumed or 0) + 1:] if s[1]] or [float("nan")])), 3),
                "worker_failovers": client.counters()["worker_failovers"],
                "rounds_failed": client.counters()["rounds_failed"]}
    finally:
        client.close()
        workers[0].proc.send_signal(signal.SIGCONT)
        for w in workers:
            w.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=20, help="engine work per step (default 20)")
    ap.add_argument("--deadline-ms", type=float, default=50,
                    help="a round's deadline: REMOTE_DRAFTER_DEADLINE_MS, and the proxy's round "
                         "deadline and wait (default 50)")
    ap.add_argument("--before", type=int, default=50, help="rounds the primary answers first (default 50)")
    ap.add_argument("--after", type=int, default=100, help="steps after the fault (default 100)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        random_llama(TINY, seed=0).save(str(Path(tmp) / "target"))
        target = str(Path(tmp) / "target")
        result = {"step_ms": args.step_ms, "deadline_ms": args.deadline_ms,
                  **{path: {fault: one_drill(target, path, fault, args) for fault in ("kill", "freeze")}
                     for path in ("sync", "async")}}
    emit_result(result, args.out, True, print)  # the figures are the JSON itself
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
