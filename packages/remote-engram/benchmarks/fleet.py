"""What several offload hosts cost and buy, on one machine (tcp loopback, real server
processes, one EngramClient as an engine rank holds it):

* steady state: a decode step's fetch (both layers, `--tokens` tokens x 24 rows) from one
  host and from two (reads spread over both), interleaved, as a ratio;
* the failover step: two hosts, the first killed (or frozen: SIGSTOP) once it has served
  rows of the drill (an observed event, not a sleep); the step in which a read met the dead
  host, against the drill's own steady p50 before;
* the fallback rate of the drill: steps whose rows came from the local shard while a host
  lived (the goal: none), and after the last host is killed (all of them).

    python packages/remote-engram/benchmarks/fleet.py --out findings/raw/offload-fleet-<date>.json
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time

import numpy as np

from ofl.cli import emit_result
from ofl.testing import stop_process
from remote_engram.client import EngramClient
from remote_engram.hashing import row_ids
from remote_engram.synth import write_shards
from remote_engram.testing import SMALL, EngramServeProcess


def steps(tokens: int, count: int, seed: int) -> list[dict]:
    """Each step's row ids per layer (rank 0 of 1: every column), from random token ids."""
    rng = np.random.default_rng(seed)
    token_map = rng.integers(0, SMALL.vocab, 4_000)
    return [{layer: row_ids(SMALL, layer, rng.integers(0, 4_000, (1, tokens)), token_map)
             for layer in SMALL.layers} for _ in range(count)]


def step_time(client: EngramClient, ids: dict) -> float:
    started = time.perf_counter()
    for layer, layer_ids in ids.items():
        client.fetch(layer, layer_ids)
    return time.perf_counter() - started


def client_for(shards: str, hosts: list[EngramServeProcess], deadline_ms: float) -> EngramClient:
    return EngramClient(geometry=SMALL, rank=0, nranks=1, shard_dir=shards,
                        remote=[h.address for h in hosts], backend="tcp",
                        deadline_s=deadline_ms / 1000, backoff_s=3600)


def steady(shards: str, args) -> dict:
    """One host vs two, step by step in turns, same ids."""
    hosts = [EngramServeProcess(shards, "tcp") for _ in range(2)]
    clients = {"one_host": client_for(shards, hosts[:1], args.deadline_ms),
               "two_hosts": client_for(shards, hosts, args.deadline_ms)}
    try:
        work = steps(args.tokens, args.steps, seed=1)
        times = {name: [] for name in clients}
        for ids in work[:20]:  # connect and warm both
            for c in clients.values():
                step_time(c, ids)
        for ids in work:
            for name, c in clients.items():
                times[name].append(step_time(c, ids))
        out = {name: {"p50_us": round(float(np.median(t)) * 1e6, 1),
                      "p99_us": round(float(np.percentile(t, 99)) * 1e6, 1)} for name, t in times.items()}
        out["two_over_one_p50"] = round(out["two_hosts"]["p50_us"] / out["one_host"]["p50_us"], 3)
        out["rows_by_host"] = [h["rows"] for h in clients["two_hosts"].host_status()]
        return out
    finally:
        for c in clients.values():
            c.close()
        for h in hosts:
            h.stop()


def drill(shards: str, args, fault: str) -> dict:
    """Two hosts; the first killed (or frozen) once it served rows of the drill, the second
    killed later."""
    hosts = [EngramServeProcess(shards, "tcp") for _ in range(2)]
    client = client_for(shards, hosts, args.deadline_ms)
    work = steps(args.tokens, 3 * args.steps, seed=2)
    stats = client.stats
    try:
        for ids in work[:20]:
            step_time(client, ids)
        served = client.host_status()[0]["rows"]
        times, failed_over, fell_back = [], [], []
        first_killed = last_killed = None
        for i, ids in enumerate(work):
            was = (stats["failovers"], stats["fallbacks"] + stats["backoff_skips"])
            times.append(step_time(client, ids))
            failed_over.append(stats["failovers"] > was[0])
            fell_back.append(stats["fallbacks"] + stats["backoff_skips"] > was[1])
            if first_killed is None and i >= args.steps and client.host_status()[0]["rows"] > served:
                if fault == "freeze":  # mid-drill, once it served rows of the drill
                    stop_process(hosts[0].proc.pid)
                else:
                    hosts[0].proc.kill()
                    hosts[0].proc.wait()
                first_killed = i
            elif first_killed is not None and last_killed is None and i >= 2 * args.steps:
                hosts[1].proc.kill()  # the last host: from here the local shard serves
                hosts[1].proc.wait()
                last_killed = i
        p50 = float(np.median(times[:first_killed + 1]))
        failover_step = next(i for i in range(first_killed + 1, len(times)) if failed_over[i])
        living = range(first_killed + 1, last_killed + 1)
        return {"steady_p50_us_before_kill": round(p50 * 1e6, 1),
                "failover_step_us": round(times[failover_step] * 1e6, 1),
                "failover_step_over_p50": round(times[failover_step] / p50, 2),
                "steps_from_kill_to_failover": failover_step - first_killed,
                "p50_us_on_the_survivor": round(float(np.median([times[i] for i in living
                                                                 if i != failover_step])) * 1e6, 1),
                "failovers": int(sum(failed_over)),
                "steps_while_a_host_lived": len(living),
                "fallback_steps_while_a_host_lived": int(sum(fell_back[i] for i in living)),
                "steps_after_the_last_host": len(times) - last_killed - 1,
                "fallback_steps_after_the_last_host": int(sum(fell_back[last_killed + 1:])),
                "host_states": [h["state"] for h in client.host_status()]}
    finally:
        client.close()
        hosts[0].proc.send_signal(signal.SIGCONT)
        for h in hosts:
            h.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16, help="tokens a decode step fetches rows for (default 16)")
    ap.add_argument("--steps", type=int, default=400, help="steps per measurement (default 400)")
    ap.add_argument("--deadline-ms", type=float, default=50, help="ENGRAM_DEADLINE_MS (default 50)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_shards(tmp, SMALL, nranks=1, seed=0)
        result = {"tokens": args.tokens, "steps": args.steps, "deadline_ms": args.deadline_ms,
                  "steady": steady(tmp, args),
                  "drill": {fault: drill(tmp, args, fault) for fault in ("kill", "freeze")}}
    emit_result(result, args.out, True, print)  # the figures are the JSON itself
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
