"""The CPU numbers of findings/drafter-tp2.md: TP2 (two gloo processes) vs the one-card
drafter's drafts on many single-request rounds, client round time one-card vs TP2 at batch
1/4/16 (CPU, tiny model: not a latency claim, only what the broadcast + all-reduces cost
here), and how long rank 0 takes to stop serving after rank 1 is killed or hung while idle.

  python packages/drafter-tp2-nvlink/benchmarks/cpu_check.py --out findings/raw/drafter-tp2-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time

from gpu_tp2 import BATCHES, parity, time_rounds  # beside this script

from drafter_tp2.launcher import free_master
from drafter_tp2.testing import PairProcess, RankPair, tp2_env, worker_args
from remote_drafter.testing import WorkerProcess, make_models


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parity-rounds", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=100, help="timed rounds per batch size")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp()
    os.environ["REMOTE_DRAFTER_LOCK_DIR"] = os.path.join(base, "locks")
    m = make_models(os.path.join(base, "models"))
    feature, vocab = 192, 96
    res = {"model": "remote-drafter's tiny test drafter (hidden 64, 4/2 heads, vocab 96, float32)"}
    t0 = time.monotonic()
    pair = PairProcess(worker_args(m), tp2_env())
    res["tp2_start_s"] = time.monotonic() - t0
    try:
        res["parity"] = parity(pair.address, m["target"], m["dspark"], args.parity_rounds, "cpu")
        res["tp2_round_ms"] = {b: time_rounds(pair.address, m["target"], feature, vocab, b, args.rounds)
                               for b in BATCHES}
    finally:
        pair.stop()
    one = WorkerProcess(m["dspark"], m["target"])
    try:
        res["one_card_round_ms"] = {b: time_rounds(one.address, m["target"], feature, vocab, b, args.rounds)
                                    for b in BATCHES}
    finally:
        one.stop()
    for fault, sig in (("killed", signal.SIGKILL), ("hung", signal.SIGSTOP)):
        ranks = RankPair(worker_args(m), free_master("127.0.0.1:0"))
        try:
            ranks.ready()
            t0 = time.monotonic()
            os.kill(ranks.procs[1].pid, sig)
            code = ranks.procs[0].wait(timeout=60)
            res[f"rank1_{fault}_idle"] = {"rank0_exit": code, "seconds_to_stop": time.monotonic() - t0,
                                          "deadline_s": float(tp2_env()["DRAFTER_TP2_TIMEOUT_S"])}
        finally:
            ranks.kill()
    p = res["parity"]
    print(f"parity: {p['identical']}/{p['rounds']} rounds identical (gaps {p['difference_top2_gaps']})")
    for b in BATCHES:
        print(f"batch {b:2}: one-card p50 {res['one_card_round_ms'][b]['p50_ms']:.2f} ms, "
              f"TP2 p50 {res['tp2_round_ms'][b]['p50_ms']:.2f} ms (CPU, not a claim)")
    print(f"rank 1 killed: rank 0 stopped in {res['rank1_killed_idle']['seconds_to_stop']:.2f} s; "
          f"hung: {res['rank1_hung_idle']['seconds_to_stop']:.2f} s (deadline 3 s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
