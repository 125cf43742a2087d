"""Session 19: py-spy (2 kHz, 25 s) on a stub worker in its own process while a client drives
batch-16 rounds over tcp loopback, then the shares of the worker's busy time (its connection
thread, less the idle wait for the next request) by function, as findings/exl3-drafter.md
§ session 19 quotes them. Needs py-spy (`pip install py-spy`; PY_SPY=<its path> if it is not
on PATH). From the repository root:

    python findings/raw/worker-process-profile-harness-cpu-2026-12-05-s19.py
"""

import collections
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, "packages/remote-drafter/benchmarks")
import worker_cost  # noqa: E402
from dsv41_gpu import worker_process  # noqa: E402

from remote_drafter.bench import drive_rounds  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.identity import Manifest  # noqa: E402
from remote_drafter.engine.transport import RemoteTransport  # noqa: E402


def shares(stacks: str) -> tuple[int, int, collections.Counter]:
    """(busy samples, idle samples, samples per function on the busy stacks) of the worker's
    connection thread, from py-spy's raw output."""
    busy, idle, inclusive = 0, 0, collections.Counter()
    for line in open(stacks):
        stack, n = line.rsplit(" ", 1)
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        if "Server._request_loop" not in names:
            continue
        if names[-1] == "Channel._ready" and "Channel.wait_readable" in names:
            idle += int(n)  # waiting for the next request: not the round's
            continue
        busy += int(n)
        inclusive.update({name: int(n) for name in set(names)})
    return busy, idle, inclusive


def main() -> None:
    drafter = worker_cost.stub_drafter("bfloat16")
    proc, address = worker_process("packages/remote-drafter/benchmarks/worker_cost.py", "stub", "bfloat16")
    client = DrafterClient(RemoteTransport(address, "tcp", Manifest()), f"64:{drafter.max_depth}",
                           deadline_s=30.0, row_dtype="bfloat16")

    def rounds(n: int, seed: int, warm: int) -> None:
        drive_rounds(client, 16, n, drafter.max_depth, drafter.vocab_size, drafter.feature, "sync", 0.0,
                     seed=seed, row_dtype="bfloat16", warm_rounds=warm)

    rounds(50, 16, worker_cost.in_service(drafter.window))  # requests in service first
    stacks = os.path.join(tempfile.mkdtemp(), "spy-worker.txt")
    spy = subprocess.Popen([os.environ.get("PY_SPY", "py-spy"), "record", "-r", "2000", "-f", "raw", "-o", stacks,
                            "-p", str(proc.pid), "-d", "25"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started, seed = time.monotonic(), 17
    while time.monotonic() - started < 20:  # inside the profile's 25 s
        rounds(100, seed, 0)
        seed += 1
    spy.wait()
    client.close()
    proc.stdin.close()
    proc.wait()
    busy, idle, inclusive = shares(stacks)
    print(f"busy samples {busy}, idle (waiting for a request) {idle}")
    for name in ("Server.answer", "Channel._recv_some", "Channel._wait", "Server._send_reply"):
        print(f"{100 * inclusive[name] / busy:5.1f}% {name}")


if __name__ == "__main__":
    main()
