"""`dsv41-stack`: the DSV41 offload stack's launcher.

  dsv41-stack demo                                   # the whole deployment in miniature, here
  dsv41-stack preflight --env F --role offload-host  # PASS/FAIL per check, exit 1 on a FAIL
  dsv41-stack up --env stack/env/local.env           # configuration D here; then canary
  dsv41-stack status | logs engine | canary | down   (each with --env)
  dsv41-stack rollback remote-engram --env F --write F.rollback   # then restart the engine
  dsv41-stack args --env production-D.env --role offload-host
  dsv41-stack args --env production-D.env --env production-async.env --role engine --rank 1

An engine across two hosts (STACK_ENGINE_NODES=2): on the second Spark `up --role engine
--rank 1` first (vLLM's headless worker: it waits for rank 0), then on the first `up --role
engine --rank 0` (the API; it waits until both ranks serve, then runs the canary).
  dsv41-stack template production-D > production-D.env   # then replace every <placeholder>
  dsv41-stack env                                    # every setting and component variable

Env files hold STACK_* settings and the components' own variables (ENGRAM_*,
REMOTE_DRAFTER_*, VLLM_DSPARK_REMOTE_ASYNC, ASYNC_HANDOFF_*, OFL_*), passed to the processes
that read them (`env` lists both). Later --env files override earlier ones.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from .config import ConfigError, StackConfig
from .roles import roles
from .settings import SETTINGS, component_envs, shown

TEMPLATES = ("local", "production-D", "production-async", "production-fleet")
ROLES = ["offload-host", "engine", "engram-server", "drafter-worker"]
ROLE_HELP = ("offload-host (its engram-server and drafter-worker, or one of them) or engine "
             "(with --rank); default: every role")
RANK_HELP = ("with --role engine: this host's node rank when the engine spans STACK_ENGINE_NODES "
             "hosts (0: the API server, default; 1: vLLM's headless worker on the second host)")


def templates_dir() -> Path:
    here = Path(__file__).resolve().parent
    packaged = here / "templates"  # in a wheel
    return packaged if packaged.is_dir() else here.parents[1] / "env"  # in the repository


def template_path(name: str) -> Path:
    folder = templates_dir()
    return folder / (f"{name}.env" if name == "local" else f"{name}.env.example")


def print_variables(variables) -> None:
    for v in variables:
        print(f"{v.name}={v.default}\n    {v.doc}" + (f"\n    Takes: {v.takes()}." if v.takes() else ""))


def cmd_env(args) -> int:
    print_variables(SETTINGS)
    for module in component_envs():  # as each component declares them
        print(f"\n# {module.__name__}")
        print_variables(module.ALL)
    return 0


def cmd_template(args) -> int:
    sys.stdout.write(template_path(args.name).read_text())
    return 0


def cmd_args(args) -> int:
    cfg = StackConfig.load(args.env)
    for role in roles(cfg, args.role, args.rank):
        print(f"# {role.name}")
        for key, value in sorted(role.env.items()):
            print(f"{key}={shlex.quote(shown(key, value))}")
        print(shlex.join(role.command) + "\n")
    return 0


def cmd_preflight(args) -> int:
    from .preflight import report, run

    checks = run(StackConfig.load(args.env), args.role, args.rank)
    print(report(checks))
    failed = [c for c in checks if not c.ok]
    warned = [c for c in checks if c.ok and c.warn]
    print(f"{len(checks) - len(failed) - len(warned)} passed, {len(warned)} warnings, "
          f"{len(failed)} failed")
    return 1 if failed else 0


def cmd_up(args) -> int:
    from .deployment import Deployment

    deployment = Deployment(StackConfig.load(args.env))
    deployment.up(args.role, rank=args.rank)
    if args.role in (None, "engine") and not args.rank:  # rank 0 serves the API
        return report_canary(deployment.canary(record=args.record_canary))
    return 0


def cmd_down(args) -> int:
    from .deployment import Deployment

    Deployment(StackConfig.load(args.env)).down(args.role, rank=args.rank)
    return 0


def cmd_status(args) -> int:
    from .deployment import Deployment

    status = Deployment(StackConfig.load(args.env)).status(args.role, args.rank)
    print(json.dumps(status, indent=2))
    return 0 if all(s["running"] for s in status.values()) else 1


def cmd_logs(args) -> int:
    log = Path(StackConfig.load(args.env)["STACK_RUN_DIR"]) / "logs" / f"{args.role}.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    print("\n".join(lines[-args.lines:]) if lines else f"no log at {log}")
    return 0


def report_canary(result: dict) -> int:
    if errors := result.get("errors"):
        first = next(iter(errors.items()))
        print(f"canary: FAILED, {len(errors)} prompts not answered (nothing recorded); "
              f"{first[0]!r}: {first[1][:300]}")
    elif result["recorded"]:
        print(f"canary: recorded the reference fingerprint {result['fingerprint'][:16]}")
    elif result["fingerprint"] == result["reference"]:
        print(f"canary: output ok, fingerprint {result['fingerprint'][:16]} = the reference")
    else:
        print(f"canary: FAILED, fingerprint {result['fingerprint'][:16]} != reference "
              f"{result['reference'][:16]} (prompts differing: {result['differs']})")
    if result["degraded"]:
        print(f"canary: DEGRADED: {'; '.join(result['degraded'])}")
    elif result["ok"] and result.get("checked"):
        print(f"canary: ok, counters fresh ({', '.join(result['checked'])})")
        if moved := result.get("handoff"):
            print(f"canary: async proxy ok: {moved['rounds_ok']:.0f} rounds answered, "
                  f"{moved['rounds_failed']:.0f} failed, {moved['watchdog_fires']:.0f} watchdog "
                  f"fires, {moved['respawns']:.0f} respawns")
    return 0 if result["ok"] else 1


def cmd_canary(args) -> int:
    from .deployment import Deployment

    return report_canary(Deployment(StackConfig.load(args.env)).canary(record=args.record))


def cmd_rollback(args) -> int:
    from .rollback import LEVERS, RESTART, rollback, write_env

    cfg = rollback(StackConfig.load(args.env), args.lever)
    who, how = RESTART.get(args.lever, RESTART["engine"])
    write_env(cfg, Path(args.write), f"dsv41-stack rollback {args.lever} of {', '.join(args.env)}\n"
              f"after a restart of {who}: {LEVERS[args.lever]}")
    print(f"wrote {args.write}: {LEVERS[args.lever]}.\nNothing changes until {who} restarts "
          f"with it: {how.format(out=args.write)}")
    return 0


def cmd_systemd(args) -> int:
    from .systemd import SECRETS_FILE, write_units

    paths = write_units(StackConfig.load(args.env), args.env, args.role, Path(args.out), args.rank)
    print("\n".join(f"wrote {p}" for p in paths))
    print(f"install: cp {args.out}/*.service {args.out}/*.timer /etc/systemd/system/ && "
          "systemctl daemon-reload && systemctl enable --now dsv41-watchdog.timer " + " ".join(
              p.name for p in paths if p.name.endswith(".service") and "watchdog" not in p.name))
    if any(p.name == SECRETS_FILE for p in paths):
        print(f"the units read OFL_AUTH_KEY from {Path(args.out).resolve() / SECRETS_FILE} "
              "(mode 0600): keep it there")
    return 0


def cmd_watchdog(args) -> int:
    from .systemd import watchdog

    cfg = StackConfig.load(args.env)
    said = watchdog(cfg, args.role, Path(cfg["STACK_RUN_DIR"]) / "watchdog.json", rank=args.rank)
    print("\n".join(said) or "every role serves")
    return 1 if any("left down" in line for line in said) else 0


def cmd_demo(args) -> int:
    from rich.console import Console

    from .demo import run, table

    console = Console(stderr=True)
    cfg = StackConfig.load(args.env or [template_path("local")])
    out = Path(args.out or Path(cfg["STACK_RUN_DIR"]) / "results")
    report = run(cfg, args.base, out, args.contexts, args.repeats, args.output_len,
                 say=lambda text: console.log(text))
    print(table(report))
    print(f"results: {out}/demo.json, {out}/demo.png")
    return 0 if report["identical_output"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv41-stack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env", help="every STACK_ setting and the components' variables (ofl, "
                   "remote_engram, remote_drafter, async_handoff), with default and meaning") \
        .set_defaults(func=cmd_env)
    t = sub.add_parser("template", help="print an env template")
    t.add_argument("name", choices=TEMPLATES)
    t.set_defaults(func=cmd_template)
    a = sub.add_parser("args", help="dry run: each process's environment and command line")
    a.add_argument("--env", action="append", required=True, help="env file (repeatable)")
    a.add_argument("--role", choices=ROLES, help=ROLE_HELP)
    a.add_argument("--rank", type=int, help=RANK_HELP)
    a.set_defaults(func=cmd_args)
    for name, func, text in (("preflight", cmd_preflight, "is this machine ready for its roles: "
                               "versions, shards, ports, memory, mlock, links, qualify, GPUs"),
                             ("up", cmd_up, "start this machine's roles in the reference order, "
                               "each waited for; then the canary"),
                              ("down", cmd_down, "stop this machine's roles (the engine first)"),
                              ("status", cmd_status, "each role's process and what it says of "
                               "itself: the engine's spec-decode, Engram and async proxy "
                               "counters, the Engram server's health, the worker's counters "
                               "(exit 1 if one is down)")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--env", action="append", required=True, help="env file (repeatable)")
        c.add_argument("--role", choices=ROLES, help=ROLE_HELP)
        c.add_argument("--rank", type=int, help=RANK_HELP)
        if name == "up":
            c.add_argument("--record-canary", action="store_true",
                           help="record this start's fingerprint as the canary's reference")
        c.set_defaults(func=func)
    g = sub.add_parser("logs", help="the last lines of a role's log")
    g.add_argument("role", choices=["engram-server", "drafter-worker", "engine", "engine-rank1"])
    g.add_argument("--env", action="append", required=True)
    g.add_argument("-n", "--lines", type=int, default=40)
    g.set_defaults(func=cmd_logs)
    c = sub.add_parser("canary", help="greedy fingerprint of fixed prompts vs the recorded one, "
                       "and fresh counters (drafts, Engram, the async proxy's rounds)",
                       description="Asks rank 0's API (STACK_ENGINE_LISTEN). Exit 1 if the "
                       "fingerprint differs or a counter is not fresh (DEGRADED): no drafts, an "
                       "Engram fallback, or with VLLM_DSPARK_REMOTE_ASYNC on, the async proxy "
                       "answered no round, failed one, or its watchdog fired "
                       "(ASYNC_HANDOFF_METRICS_LISTEN).")
    c.add_argument("--env", action="append", required=True)
    c.add_argument("--record", action="store_true", help="record it as the reference")
    c.set_defaults(func=cmd_canary)
    r = sub.add_parser("rollback", help="write the env file of a lever's reference rollback",
                       description="async: synchronous rounds; remote-drafter: the drafter in "
                       "the engine with the baseline KV budget; remote-engram: the local shard "
                       "reader: each takes effect when the engine restarts with the written "
                       "file. tp2-worker: the one-card worker with the same drafter, target and "
                       "listener: takes effect when the offload host's drafter worker restarts "
                       "with it (the engines keep running and reconnect).")
    r.add_argument("lever", choices=["async", "remote-drafter", "remote-engram", "tp2-worker"])
    r.add_argument("--env", action="append", required=True)
    r.add_argument("--write", required=True, help="the env file to write")
    r.set_defaults(func=cmd_rollback)
    u = sub.add_parser("systemd", help="write systemd units for this machine's roles and the "
                       "watchdog timer")
    u.add_argument("--env", action="append", required=True)
    u.add_argument("--role", choices=ROLES, help=ROLE_HELP)
    u.add_argument("--rank", type=int, help=RANK_HELP)
    u.add_argument("--out", required=True, help="folder for the unit files")
    u.set_defaults(func=cmd_systemd)
    w = sub.add_parser("watchdog", help="one pass: restart (bounded) a role that runs but does "
                       "not serve (the timer runs it every 30 s)")
    w.add_argument("--env", action="append", required=True)
    w.add_argument("--role", choices=ROLES, help=ROLE_HELP)
    w.add_argument("--rank", type=int, help=RANK_HELP)
    w.set_defaults(func=cmd_watchdog)
    d = sub.add_parser("demo", help="the deployment in miniature on this machine (A, B, D, D-async, D-fleet)",
                       description="Builds the SmolLM2-with-Engram target if needed, starts the "
                       "Engram server, the drafter worker and one vLLM per configuration, "
                       "measures each with longctx-bench, prints the table; stops everything "
                       "it started. Needs vLLM (tools/vllm-cpu-env.sh).")
    d.add_argument("--env", action="append", help="env file(s) (default: the local template)")
    d.add_argument("--base", default=".artifacts/smollm2-135m",
                   help="SmolLM2-135M folder the miniature is built from")
    d.add_argument("--out", help="results folder (default: STACK_RUN_DIR/results)")
    d.add_argument("--contexts", default="256,1024")
    d.add_argument("--repeats", type=int, default=2)
    d.add_argument("--output-len", type=int, default=32)
    d.set_defaults(func=cmd_demo)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, OSError, RuntimeError) as exc:
        print(f"dsv41-stack: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
