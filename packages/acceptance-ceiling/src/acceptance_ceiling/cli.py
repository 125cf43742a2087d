"""acceptance-ceiling: expected acceptance of a drafter, its ceiling, and what it buys.

  acceptance-ceiling report --demo --temperature 1 --k-max 5 --out report.json --plot report.png
  acceptance-ceiling report --logprobs logprobs.json --k-max 5 --out report.json
  acceptance-ceiling measure --demo --temperature 1 --k 3 --out measured.json  # exit 1: disagrees
  acceptance-ceiling validate report.json longctx-result.json --k 3  # exit 1 when outside
  acceptance-ceiling report ... --cost 5,0.2,1,0.3,0.5 --batches 1,4,16   # best k per batch

--cost is verify_base_ms,verify_per_row_ms,draft_base_ms,draft_per_token_ms,overhead_ms.
`measure` checks itself against the exact expectation at the round starts it visited (the
sharp check); `validate` holds a measurement against the report's interval, which is over
the prompts' own positions: a run visits other contexts, so it is the coarse check.
Exit codes: 0 ok or inside, 1 disagrees or outside, 2 a usage error (a file, a value).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from . import __version__
from .chain import exact
from .cost import RoundCost, depth_table
from .loop import speculative_generate
from .pairs import MarkovPair, load_logprobs
from .report import interval, logprob_report, model_report


def demo_pair(args) -> MarkovPair:
    return MarkovPair(vocab=args.vocab, noise=args.noise, seed=args.seed,
                      temperature=args.temperature, top_p=args.top_p)


def demo_prompts(pair: MarkovPair, n: int, length: int, seed: int) -> dict[str, list]:
    """Prompts sampled from the target itself (one class, "demo")."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(n):
        seq = [int(rng.integers(pair.vocab))]
        while len(seq) < length:
            p = pair.target(seq) if pair.temperature > 0 else np.full(pair.vocab, 1 / pair.vocab)
            seq.append(int(rng.choice(pair.vocab, p=p)))
        out.append(seq)
    return {"demo": out}


def cmd_report(args) -> int:
    if args.logprobs:
        result = logprob_report(load_logprobs(args.logprobs), args.k_max)
    else:
        pair = demo_pair(args)
        result = model_report(pair.target, pair.drafter,
                              demo_prompts(pair, args.prompts, args.prompt_len, args.seed),
                              args.k_max, samples=args.samples, seed=args.seed)
    result.update(version=__version__, temperature=args.temperature, top_p=args.top_p,
                  settings={k: v for k, v in vars(args).items() if k != "func"})
    if args.cost:
        cost = RoundCost.parse(args.cost)
        for cls in result["classes"].values():
            expected = {int(k): v["accepted_length"]["mean"] - 1 for k, v in cls["k"].items()}
            cls["depth_table"] = depth_table(cost, expected, [int(b) for b in args.batches.split(",")])
    print_report(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    return 0


def print_report(result: dict) -> None:
    for name, cls in result["classes"].items():
        print(f"class {name}: {cls['prompts']} prompts; method: {', '.join(cls['method'])}")
        print(f"  {'k':>3} {'accepted length (95% CI)':>30} {'token-only oracle':>18}")
        for k, v in cls["k"].items():
            a = v["accepted_length"]
            o = v.get("oracle_accepted_length")
            print(f"  {k:>3} {a['mean']:10.3f} [{a['low']:.3f}, {a['high']:.3f}] n={a['n']:<4}"
                  f" {o['mean'] if o else float('nan'):18.3f}")
        for b, row in (cls.get("depth_table") or {}).get("batches", {}).items():
            print(f"  batch {b}: best k = {row['k']}, predicted speedup {row['speedup']:.2f}x "
                  "over target-only")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, cls in result["classes"].items():
        ks = [int(k) for k in cls["k"]]
        a = [cls["k"][str(k)]["accepted_length"] for k in ks]
        ax.errorbar(ks, [x["mean"] for x in a], yerr=[[x["mean"] - x["low"] for x in a],
                    [x["high"] - x["mean"] for x in a]], marker="o", capsize=3, label=name)
        if "oracle_accepted_length" in cls["k"][str(ks[0])]:
            ax.plot(ks, [cls["k"][str(k)]["oracle_accepted_length"]["mean"] for k in ks], "--",
                    label=f"{name} oracle")
    ax.set_xlabel("draft depth k")
    ax.set_ylabel("tokens per round (1 + accepted)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_measure(args) -> int:
    """Run the reference speculative loop and check it against the exact expectation at
    the very contexts its rounds started from. Per round, accepted - E_k(start) is a
    martingale difference (mean 0, uncorrelated across rounds), so the paired mean over all
    rounds must have 0 in its 95% interval when the prediction is right."""
    pair = demo_pair(args)
    prompts = demo_prompts(pair, args.prompts, args.prompt_len, args.seed)["demo"]
    rng = np.random.default_rng(args.seed + 7)
    accepted, expected = [], []
    for p in prompts:
        res = speculative_generate(pair.target, pair.drafter, p, args.k, args.new_tokens, rng)
        accepted += res.accepted
        expected += [exact(pair.target, pair.drafter, pre[-8:], args.k).mean
                     for pre in res.round_starts]
    diff = interval(np.subtract(accepted, expected).tolist())
    inside = diff["low"] <= 0 <= diff["high"]
    out = {"k": args.k, "temperature": args.temperature, "prompts": len(prompts),
           "rounds": len(accepted), "mean_accepted_length": 1 + float(np.mean(accepted)),
           "predicted_accepted_length": 1 + float(np.mean(expected)),
           "paired_difference": diff, "prediction_agrees": inside,
           "source": "reference speculative loop (acceptance_ceiling.loop)"}
    print(f"k={args.k} T={args.temperature}: measured {out['mean_accepted_length']:.3f}, exact "
          f"prediction on the same {len(accepted)} round starts "
          f"{out['predicted_accepted_length']:.3f}; paired difference {diff['mean']:+.3f} "
          f"[{diff['low']:+.3f}, {diff['high']:+.3f}] -> {'agrees' if inside else 'DISAGREES'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if inside else 1


def measured_value(obj: dict) -> float:
    """Mean accepted length from a `measure` JSON or a longctx-bench result (cells'
    spec-decode counters, drafts-weighted)."""
    if "mean_accepted_length" in obj:
        return float(obj["mean_accepted_length"])
    drafts = accepted = 0.0
    for cell in obj.get("cells", []):
        sd = cell.get("spec_decode") or {}
        drafts += sd.get("num_drafts", 0)
        accepted += sd.get("num_accepted_tokens", 0)
    if not drafts:
        raise ValueError("no mean_accepted_length and no spec-decode counters in the file")
    return 1 + accepted / drafts


def cmd_validate(args) -> int:
    with open(args.predicted) as f:
        predicted = json.load(f)
    with open(args.measured) as f:
        obj = json.load(f)
    if obj.get("k") is not None and int(obj["k"]) != args.k:
        raise ValueError(f"{args.measured} was measured at k={obj['k']}, not --k {args.k}")
    measured = measured_value(obj)
    classes = predicted["classes"]
    if args.cls and args.cls not in classes:
        raise ValueError(f"no class {args.cls!r} in {args.predicted} (it has {', '.join(classes)})")
    cls = classes[args.cls] if args.cls else next(iter(classes.values()))
    if str(args.k) not in cls["k"]:
        raise ValueError(f"{args.predicted} predicts k = {', '.join(cls['k'])}, not {args.k}")
    band = cls["k"][str(args.k)]["accepted_length"]
    inside = band["low"] <= measured <= band["high"]
    print(f"k={args.k}: measured {measured:.3f}, predicted {band['mean']:.3f} "
          f"[{band['low']:.3f}, {band['high']:.3f}] -> {'inside' if inside else 'OUTSIDE'}")
    if "prediction_agrees" in obj:  # a `measure`: its own check on the round starts it visited
        print(f"  (measure's exact prediction on its own round starts, {obj['predicted_accepted_length']:.3f}: "
              f"{'agrees' if obj['prediction_agrees'] else 'DISAGREES'}; the report's interval is over "
              "the prompts' own positions, other contexts than a run visits)")
    return 0 if inside else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="acceptance-ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def models(sp):
        sp.add_argument("--demo", action="store_true", help="the built-in tiny Markov pair")
        sp.add_argument("--vocab", type=int, default=12)
        sp.add_argument("--noise", type=float, default=0.7, help="drafter's distance (0.7)")
        sp.add_argument("--temperature", type=float, default=1.0)
        sp.add_argument("--top-p", type=float, default=1.0)
        sp.add_argument("--prompts", type=int, default=40)
        sp.add_argument("--prompt-len", type=int, default=6)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--out")

    r = sub.add_parser("report", help="expected acceptance per class and depth, and the ceiling")
    models(r)
    r.add_argument("--logprobs", help="per-position top-k logprobs (JSON) instead of models")
    r.add_argument("--k-max", type=int, default=5)
    r.add_argument("--samples", type=int, default=2000, help="Monte Carlo samples when needed")
    r.add_argument("--cost", help="v0,v1,d0,d1,overhead in ms: adds the best-k table")
    r.add_argument("--batches", default="1,4,16")
    r.add_argument("--plot")
    r.set_defaults(func=cmd_report)

    m = sub.add_parser("measure", help="the reference speculative loop on the demo pair")
    models(m)
    m.add_argument("--k", type=int, default=3)
    m.add_argument("--new-tokens", type=int, default=200)
    m.set_defaults(func=cmd_measure)

    v = sub.add_parser("validate", help="is a measured mean accepted length inside the prediction?")
    v.add_argument("predicted")
    v.add_argument("measured", help="`measure` JSON or a longctx-bench result")
    v.add_argument("--k", type=int, required=True)
    v.add_argument("--cls", help="workload class (default: the first)")
    v.set_defaults(func=cmd_validate)

    args = p.parse_args(argv)
    if args.cmd in ("report", "measure") and not (args.demo or getattr(args, "logprobs", None)):
        p.error("give --demo (or --logprobs FILE for report); torch pairs: the Python API")
    try:
        return args.func(args)
    except (OSError, ValueError) as exc:  # a missing file, a bad value: one line, exit 2 (1 is "outside")
        print(f"acceptance-ceiling {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
