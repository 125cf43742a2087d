"""drafter-tp2: the drafter worker on two cards (the one-card protocol): the DSpark drafter in
tensor parallel, or DeepSeek's own drafter (dsv41:DIR) with its experts split.

  drafter-tp2 worker    --drafter DIR --target DIR [--devices cuda:0,cuda:1] [--listen HOST:PORT [--insecure]]
  drafter-tp2 supervise [--restarts N --window-s S] -- WORKER ARGS
  drafter-tp2 rank      --rank 0|1 --master HOST:PORT WORKER ARGS   (what `worker` starts)
  drafter-tp2 env

Exit codes: 0 stopped on request, 2 refused to start (pair safety, device lock, bad
input; the reason is on stderr), 3 stopped serving (a rank died or hung), 1 the
supervisor gave up.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ofl.env import describe
from remote_drafter.worker.capacity import add_capacity_args, capacity_argv
from remote_drafter.worker.exposure import add_exposure_args, exposure_argv, listen_refusal

from . import env


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True,
                   help="a DSpark checkpoint folder (remote-drafter init; tensor parallel), or "
                   "dsv41:DIR, DeepSeek-V4.1's (or V4's) own drafter in checkpoint or EXL3 pack DIR "
                   "(its routed experts split over the two ranks, each reading only its half)")
    p.add_argument("--target", required=True, help="the target folder (embedding, head, identity)")
    p.add_argument("--devices", default="cuda:0,cuda:1",
                   help="the two devices, rank 0's first (CPU tests: cpu:0,cpu:1)")
    add_exposure_args(p, "rank 0's HOST:PORT")  # the one-card worker's: loopback unless admitted
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="tcp", help="ofl backend: tcp, shm or verbs")
    add_capacity_args(p)  # the one-card worker's: slots, per-client quotas, idle release


def checked(args) -> tuple[list[str], str]:
    """The devices and graph mode, or a clear error (torch-free: the launcher runs it)."""
    devices = args.devices.split(",")
    if len(devices) != 2:
        raise ValueError(f"--devices names two devices, got {args.devices!r}")
    mode = env.DRAFTER_TP2_CUDA_GRAPHS.get()
    if why := env.DRAFTER_TP2_CUDA_GRAPHS.problem(mode):
        raise ValueError(why)
    return devices, mode


def rank_config(args):
    from remote_drafter.worker.capacity import capacity_config
    from remote_drafter.worker.service import ServiceConfig

    from .rank import RankConfig
    devices, mode = checked(args)
    return RankConfig(
        rank=args.rank, devices=devices, master=args.master, drafter=args.drafter,
        target=args.target, dtype=args.dtype, backend=args.backend, listen=args.listen,
        insecure=args.insecure, service=ServiceConfig(**capacity_config(args)),
        graphs=mode == "auto",
        graph_batches=[int(x) for x in env.DRAFTER_TP2_GRAPH_BATCHES.get().split(",")],
        timeout_s=env.DRAFTER_TP2_TIMEOUT_S.get_float(),
        heartbeat_s=env.DRAFTER_TP2_HEARTBEAT_S.get_float(),
        start_timeout_s=env.DRAFTER_TP2_START_TIMEOUT_S.get_float(),
        require_p2p=env.DRAFTER_TP2_REQUIRE_P2P.get() != "0")


def worker_argv(args) -> list[str]:
    """The worker arguments as given, for the ranks (both get the same)."""
    return ["--drafter", args.drafter, "--target", args.target, "--devices", args.devices,
            *exposure_argv(args), "--dtype", args.dtype, "--backend", args.backend,
            *capacity_argv(args)]


def cmd_rank(args) -> int:
    from .rank import run
    code = run(rank_config(args))
    if code:
        # After a peer died, tearing down the broken process group at interpreter exit can
        # abort (seen: SIGABRT in rank 1 once rank 0 was killed), hiding the exit code
        # that says why this rank stopped: leave without finalizers.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def cmd_worker(args) -> int:
    from .launcher import run_pair
    checked(args)  # bad arguments fail here, once, not in both ranks
    if why := listen_refusal(args):  # before both ranks load
        print(f"drafter-tp2 worker: {why}", file=sys.stderr)  # "refusing to listen on ..."
        return 2
    return run_pair(env.DRAFTER_TP2_MASTER.get(), worker_argv(args))


def cmd_supervise(args) -> int:
    from .supervisor import supervise
    if not args.worker_args or args.worker_args[0] != "--":
        raise ValueError("give the worker's arguments after --")
    command = [sys.executable, "-m", "drafter_tp2.cli", "worker", *args.worker_args[1:]]
    return supervise(command, args.restarts, args.window_s, args.backoff_s)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="drafter-tp2", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("worker", help="serve a DSpark drafter on two devices (tensor parallel 2)",
                       description="Start both ranks; rank 0 serves the one-card protocol on "
                       "--listen and prints one line with its address once warm.")
    add_worker_args(p)
    p.set_defaults(fn=cmd_worker)

    p = sub.add_parser("rank", help="one rank of the pair (the `worker` command starts two)",
                       description="Run one rank; for launching the ranks separately (both "
                       "need the same worker arguments and --master).")
    p.add_argument("--rank", type=int, required=True, choices=[0, 1])
    p.add_argument("--master", required=True, help="HOST:PORT where the two ranks meet")
    add_worker_args(p)
    p.set_defaults(fn=cmd_rank)

    p = sub.add_parser("supervise", help="run a worker pair, restarting it with a bound",
                       description="Restart the pair when it stops serving (a rank died or "
                       "hung), at most --restarts times within --window-s, then give up.")
    p.add_argument("--restarts", type=int, default=env.DRAFTER_TP2_RESTARTS.get_int(),
                   help="restarts allowed within the window (default: DRAFTER_TP2_RESTARTS)")
    p.add_argument("--window-s", type=float, default=env.DRAFTER_TP2_RESTART_WINDOW_S.get_float(),
                   help="the window in seconds (default: DRAFTER_TP2_RESTART_WINDOW_S)")
    p.add_argument("--backoff-s", type=float, default=1.0, help="pause before a restart")
    p.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then the worker's arguments")
    p.set_defaults(fn=cmd_supervise)

    p = sub.add_parser("env", help="every environment variable, its default and meaning")
    p.set_defaults(fn=lambda a: print(describe(env.ALL)) or 0)

    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input: one clear line, no traceback
        print(f"drafter-tp2 {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
