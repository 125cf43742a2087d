"""System calls a drafting round makes on the link, counted with strace on any Linux machine:
the worker's stub drafter (worker_cost.py's: fixed drafts at once, rows as wide as
DeepSeek-V4.1-Flash's taps, bf16) served over tcp loopback to a client in the same process,
at one batch, requests in service. A count no machine's speed changes, as a round's kernel
launches are (round_launches.py): where a system call is dear (the GPU tier's gVisor
sandbox) each one costs, and strace itself makes them dear, so the round's p50 under it is
reported too. Per round: the difference between a run of many rounds and one of few, so
start-up and warm-up cancel.

    python packages/remote-drafter/benchmarks/link_syscalls.py --batch 16 --out link-syscalls.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def rounds(batch: int, n: int) -> float:
    """n rounds at `batch` over tcp loopback (after the warm ones): their p50, ms."""
    import torch
    from dsv41_gpu import in_service
    from worker_cost import stub_drafter

    from remote_drafter.bench import drive_rounds
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.identity import Manifest
    from remote_drafter.engine.transport import RemoteTransport
    from remote_drafter.worker.server import Worker
    from remote_drafter.worker.service import ServiceConfig
    torch.set_num_threads(1)
    d = stub_drafter("bfloat16")
    with Worker(d, "tcp", "127.0.0.1", 0, ServiceConfig(max_requests=64)) as worker:
        client = DrafterClient(RemoteTransport(worker.address, "tcp", Manifest()), f"64:{d.max_depth}",
                               deadline_s=30.0, row_dtype="bfloat16")
        try:
            r = drive_rounds(client, batch, n, d.max_depth, d.vocab_size, d.feature, "sync", 0.0, seed=batch,
                             row_dtype="bfloat16", warm_rounds=in_service(d.window))
        finally:
            client.close()
    return r["drafting"]["p50_ms"]


def traced(batch: int, n: int) -> tuple[dict[str, int], float]:
    """This script's `rounds` in a process under `strace -f -c`: (calls by name, round p50)."""
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        run = subprocess.run(["strace", "-f", "-c", "-o", out.name, sys.executable, __file__, "--child",
                              str(batch), str(n)], capture_output=True, text=True, check=True)
        calls = {}
        for line in out.read().splitlines():
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls[parts[-1]] = int(parts[3])
    return calls, float(run.stdout.split()[-1])


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        print(rounds(int(sys.argv[2]), int(sys.argv[3])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="requests a round (default: %(default)s)")
    ap.add_argument("--rounds", default="20,120", help="few and many rounds, the difference counted "
                    "(default: %(default)s)")
    ap.add_argument("--out", default="link-syscalls.json", help="JSON results (default: %(default)s)")
    args = ap.parse_args(argv)
    if shutil.which("strace") is None:
        ap.error("needs strace (apt install strace)")
    few, many = (int(n) for n in args.rounds.split(","))
    (calls_few, _), (calls_many, p50) = traced(args.batch, few), traced(args.batch, many)
    per_round = {name: round((calls_many.get(name, 0) - calls_few.get(name, 0)) / (many - few), 1)
                 for name in set(calls_few) | set(calls_many)}
    per_round = {k: v for k, v in sorted(per_round.items(), key=lambda kv: -kv[1]) if v > 0}
    result = {"batch": args.batch, "rounds": [few, many], "syscalls_per_round": per_round,
              "syscalls_per_round_total": round(sum(per_round.values()), 1), "round_p50_ms_under_strace": p50}
    print(f"batch {args.batch}: {result['syscalls_per_round_total']} system calls a round "
          f"({', '.join(f'{k} {v}' for k, v in per_round.items())}); round p50 under strace {p50:.2f} ms")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
