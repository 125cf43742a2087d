"""longctx-bench: long-context measurements against an OpenAI-compatible server.

  longctx-bench run --base-url http://127.0.0.1:8000 --model M --contexts 8K,32K \\
      --max-concurrency 1,2 --repeats 3 --output-len 128 --save-result --label stock
  longctx-bench compare stock.json offload.json
  longctx-bench run ... --baseline best_known.json --tolerance 5%    # exit 3 on regression
  longctx-bench plot A.json B.json --out ttft.png

Exit codes: 0 ok, 1 error (also: a cell with no request answered, or fingerprint prompts
not answered), 3 regression against the baseline (also: a cell it measured, unmeasured now).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import sys

from rich.progress import Progress

from .compare import GateRefused, gate, paired_table
from .report import plot, print_table, receipt, save, wide_console
from .runner import RunConfig, failed_cells, fingerprint_errors, run

PERCENTILE_METRICS = {"ttft": "ttft_s", "step": "step_p50_s", "stream": "stream_tok_s",
                      "task": "task_s", "tpe": "tokens_per_event"}


def parse_tokens(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def parse_list(text: str, conv=int) -> list:
    return [conv(x) for x in text.split(",") if x.strip()]


def percentile_metrics(text: str) -> tuple[str, ...]:
    names = parse_list(text, str)
    if unknown := [m for m in names if m not in PERCENTILE_METRICS]:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: of {','.join(PERCENTILE_METRICS)}")
    return tuple(PERCENTILE_METRICS[m] for m in names)


def parse_tolerance(text: str) -> float:
    return float(text.rstrip("%")) / 100 if text.endswith("%") else float(text)


def cmd_run(args) -> int:
    console = wide_console(stderr=True)
    # what the end of the run needs, checked before anything is measured
    baseline = load(args.baseline) if args.baseline else None
    tolerance = parse_tolerance(args.tolerance)
    cfg = RunConfig(
        base_url=args.base_url.rstrip("/"), model=args.model,
        contexts=parse_list(args.contexts, parse_tokens),
        concurrency=parse_list(args.max_concurrency), repeats=args.repeats,
        output_len=args.output_len, temperature=args.temperature, top_p=args.top_p,
        extra_body={**json.loads(args.extra_body), **({"ignore_eos": True} if args.ignore_eos else {})},
        cold=not args.warm, seed=args.seed, request_timeout_s=args.request_timeout,
        prompt_file=args.prompt_file, tokenizer=args.tokenizer,
        capacity_drill=(int(args.capacity_drill[0]), parse_tokens(args.capacity_drill[1]))
        if args.capacity_drill else None, label=args.label,
        percentile_metrics=args.percentile_metrics,
        metric_percentiles=tuple(parse_list(args.metric_percentiles, float)))
    settings = {k: v for k, v in vars(cfg).items() if k not in ("label",)}
    total = len(cfg.contexts) * len(cfg.concurrency) * cfg.repeats
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("groups", total=total)

        class Advance:
            def advance(self):
                progress.advance(task)

        loop = asyncio.new_event_loop()
        main_task = loop.create_task(run(cfg, Advance()))
        loop.add_signal_handler(signal.SIGINT, main_task.cancel)  # Ctrl-C: keep what we have
        try:
            result = loop.run_until_complete(main_task)
        except asyncio.CancelledError:
            result = {"cells": [], "partial": True}
        loop.close()
    result["label"] = args.label
    result["receipt"] = receipt(settings, args.hardware)
    print_table(result)
    name = args.result_filename or (
        f"longctx-{args.label or 'run'}-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    if args.save_result:
        path = save(result, args.result_dir, name)
        console.print(f"wrote {path}")
        if args.plot:
            console.print(f"wrote {plot([result], path.removesuffix('.json') + '.png')}")
    if result.get("partial"):
        console.print("[yellow]interrupted: the result holds the cells measured so far[/]")
    failed = failed_cells(result)
    unanswered = fingerprint_errors(result.get("fingerprint") or {})
    for cell in failed:
        console.print(f"[red]FAILED cell {cell}[/]")
    if unanswered:
        console.print(f"[red]FAILED greedy fingerprint: {len(unanswered)} prompts not answered "
                      f"({next(iter(unanswered.values()))})[/]")
    if baseline is not None:
        try:
            problems = gate(result, baseline, tolerance)
        except GateRefused as exc:
            console.print(f"[red]gate refused: {exc}[/]")
            return 1
        for p in problems:
            console.print(f"[red]REGRESSION {p}[/]")
        if problems:
            return 3
        console.print(f"gate: within {args.tolerance} of {args.baseline}")
    if failed or unanswered:
        return 1
    return 1 if not result["cells"] and not result.get("capacity_drill") else 0


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def cmd_compare(args) -> int:
    results = [load(p) for p in args.results]
    names = [r.get("label") or os.path.basename(p) for r, p in zip(results, args.results)]
    paired_table(results, names)
    if args.baseline:
        try:
            problems = gate(results[-1], load(args.baseline), parse_tolerance(args.tolerance))
        except GateRefused as exc:
            print(f"gate refused: {exc}", file=sys.stderr)
            return 1
        for p in problems:
            print(f"REGRESSION {p}")
        return 3 if problems else 0
    return 0


def cmd_plot(args) -> int:
    print(plot([load(p) for p in args.results], args.out))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="longctx-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure a matrix of contexts x concurrency")
    r.add_argument("--base-url", default="http://127.0.0.1:8000")
    r.add_argument("--model", required=True)
    r.add_argument("--contexts", default="8K", help="comma list, K = 1024 tokens (8K)")
    r.add_argument("--max-concurrency", default="1", help="comma list of concurrent requests (1)")
    r.add_argument("--repeats", type=int, default=3, help="groups per cell (3)")
    r.add_argument("--output-len", type=int, default=128, help="max_tokens per request (128)")
    r.add_argument("--ignore-eos", action="store_true", help="vLLM: always generate output-len")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--extra-body", default="{}", help="JSON merged into every request body "
                   "(thinking/reasoning settings, ...)")
    r.add_argument("--warm", action="store_true", help="re-send one prompt per cell (default: "
                   "cold, a fresh random salt per request)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--prompt-file", help="text to build prompts from (default: synthetic)")
    r.add_argument("--tokenizer", help="tokenizer.json, when the server has no /tokenize")
    r.add_argument("--capacity-drill", nargs=2, metavar=("N", "CONTEXT"),
                   help="N concurrent requests at CONTEXT tokens: all complete or not")
    r.add_argument("--percentile-metrics", default="ttft,step", type=percentile_metrics,
                   help=f"metrics to report percentiles of, over a cell's requests: "
                        f"{','.join(PERCENTILE_METRICS)} (ttft,step)")
    r.add_argument("--metric-percentiles", default="50,99", help="which percentiles (50,99)")
    r.add_argument("--request-timeout", type=float, default=1800.0)
    r.add_argument("--label", default="")
    r.add_argument("--hardware", default="", help="what the server runs on (the gate compares it)")
    r.add_argument("--save-result", action="store_true")
    r.add_argument("--result-dir", default=".")
    r.add_argument("--result-filename")
    r.add_argument("--plot", action="store_true", help="with --save-result: also a PNG")
    r.add_argument("--baseline", help="best-known result JSON: exit 3 on a regression")
    r.add_argument("--tolerance", default="5%")
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("compare", help="paired table of results (and the gate)")
    c.add_argument("results", nargs="+")
    c.add_argument("--baseline")
    c.add_argument("--tolerance", default="5%")
    c.set_defaults(func=cmd_compare)
    pl = sub.add_parser("plot", help="TTFT and step p50 against context")
    pl.add_argument("results", nargs="+")
    pl.add_argument("--out", default="longctx.png")
    pl.set_defaults(func=cmd_plot)
    args = p.parse_args(argv)
    try:
        return args.func(args)
    except (OSError, ValueError, RuntimeError) as exc:  # a wrong path or value, no server: one line
        print(f"longctx-bench {args.cmd}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
