"""System calls a drafting round makes on the link, counted with strace on any Linux machine:
the worker's stub drafter (worker_cost.py's: fixed drafts at once, rows as wide as
DeepSeek-V4.1-Flash's taps, bf16) in a worker process of its own, as deployed, served over
tcp loopback to a client, at one batch, requests in service; both processes traced. Where a
system call is dear (the GPU tier's gVisor sandbox) each one costs, and strace itself makes
them dear, so the round's p50 under it is reported too. Per round: the difference between a
run of many rounds and one of few, so start-up and warm-up cancel; each the median of
--repeats runs (how a payload arrives in pieces, and so the receives and waits, varies from
run to run).

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

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def rounds(batch: int, n: int) -> float:
    """n rounds at `batch` over tcp loopback to a worker process (after the warm ones): their p50, ms."""
    import torch
    import worker_cost
    from dsv41_gpu import in_service, worker_process

    from remote_drafter.bench import drive_rounds
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.identity import Manifest
    from remote_drafter.engine.transport import RemoteTransport
    torch.set_num_threads(1)
    d = worker_cost.stub_drafter("bfloat16")
    proc, address = worker_process(worker_cost.__file__, "stub", "bfloat16")
    with proc:
        client = DrafterClient(RemoteTransport(address, "tcp", Manifest()), f"64:{d.max_depth}",
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
                              str(batch), str(n)], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"the traced rounds failed ({run.returncode}):\n{run.stderr[-3000:]}")
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
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, the median kept (default: %(default)s)")
    ap.add_argument("--out", default="link-syscalls.json", help="JSON results (default: %(default)s)")
    args = ap.parse_args(argv)
    if shutil.which("strace") is None:
        ap.error("needs strace (apt install strace)")
    few, many = (int(n) for n in args.rounds.split(","))
    runs = []
    for _ in range(args.repeats):
        (calls_few, _), (calls_many, p50) = traced(args.batch, few), traced(args.batch, many)
        runs.append(({name: (calls_many.get(name, 0) - calls_few.get(name, 0)) / (many - few)
                      for name in set(calls_few) | set(calls_many)}, p50))
    names = set().union(*(r for r, _ in runs))
    per_round = {name: round(float(np.median([r.get(name, 0) for r, _ in runs])), 1) for name in names}
    per_round = {k: v for k, v in sorted(per_round.items(), key=lambda kv: -kv[1]) if v > 0}
    totals = [round(sum(r.values()), 1) for r, _ in runs]
    p50 = float(np.median([p for _, p in runs]))
    result = {"batch": args.batch, "rounds": [few, many], "repeats": args.repeats, "syscalls_per_round": per_round,
              "syscalls_per_round_total": round(float(np.median(totals)), 1), "totals_of_each_run": totals,
              "round_p50_ms_under_strace": p50, "round_p50_ms_of_each_run": [p for _, p in runs]}
    print(f"batch {args.batch}: {result['syscalls_per_round_total']} system calls a round "
          f"({', '.join(f'{k} {v}' for k, v in per_round.items())}); round p50 under strace {p50:.2f} ms")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
