"""`drafter-tp2 worker`: start both ranks as child processes, forward rank 0's ready line
(with both pids), and keep the pair whole: when either rank exits, the other is stopped and
the worker exits with the reason (2: refused to start, 3: stopped serving)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

from ofl.server import parse_address

GRACE_S = 10.0  # a rank's time to stop after SIGTERM before it is killed
# The launcher's own bound after SIGTERM: rank 0's grace, then rank 1's wait for the stop
# order and its grace, and a margin for the launcher's exit. Whoever stops a launcher waits this.
LAUNCHER_GRACE_S = 3 * GRACE_S + 5.0


def free_master(master: str) -> str:
    host, port = parse_address(master, 0)
    if port == 0:  # a free port now; the ranks bind it a moment later
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    return f"{host}:{port}"


def rank_command(rank: int, master: str, rank_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "drafter_tp2.cli", "rank", "--rank", str(rank),
            "--master", master, *rank_args]


def stop_process(proc: subprocess.Popen, name: str, grace_s: float = GRACE_S) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # a stopped (hung) process cannot handle SIGTERM
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            print(f"drafter-tp2: {name} did not stop within {grace_s:.0f} s of "
                  "SIGTERM; killing it", file=sys.stderr, flush=True)
            proc.kill()
            proc.wait()


def run_pair(master: str, rank_args: list[str]) -> int:
    master = free_master(master)
    ranks = [subprocess.Popen(rank_command(r, master, rank_args), text=True,
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL)
             for r in range(2)]
    term = []
    signal.signal(signal.SIGTERM, lambda *a: term.append(1))
    signal.signal(signal.SIGINT, lambda *a: term.append(1))
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(ranks[0].stdout.readline()), daemon=True)
    reader.start()
    while reader.is_alive() and not term and all(p.poll() is None for p in ranks):
        reader.join(0.1)  # either rank may refuse (or die) before rank 0 serves
    line = ready[0] if ready else ""
    if " on " not in line:
        deadline = time.monotonic() + 1.0  # the other rank may be refusing too: let it say why
        while not term and time.monotonic() < deadline and any(p.poll() is None for p in ranks):
            time.sleep(0.05)
        codes = [p.poll() for p in ranks]
        for r, proc in enumerate(ranks):
            stop_process(proc, f"rank {r}")
        if term:
            return 0
        print(f"drafter-tp2 worker: the pair did not start (exit codes {codes}; the reason "
              "is above)", file=sys.stderr, flush=True)
        return 2 if 2 in codes else 3
    head, address = line.rsplit(" on ", 1)
    print(f"drafter-tp2 worker: {head.split(': ', 1)[1]} (rank pids {ranks[0].pid},{ranks[1].pid}) "
          f"on {address.strip()}", flush=True)
    while not term:
        for r, proc in enumerate(ranks):
            code = proc.poll()
            if code is not None:
                for o, other in enumerate(ranks):
                    stop_process(other, f"rank {o}")
                how = f"signal {-code}" if code < 0 else f"exit {code}"
                print(f"drafter-tp2 worker: rank {r} ended ({how}); the pair stopped serving",
                      file=sys.stderr, flush=True)
                return 3
        time.sleep(0.1)
    # rank 0 finishes its round, stops rank 1, then releases its lock
    stop_process(ranks[0], "rank 0")
    try:
        ranks[1].wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        stop_process(ranks[1], "rank 1")
    return 0
