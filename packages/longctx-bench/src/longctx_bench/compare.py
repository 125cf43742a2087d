"""compare A.json B.json ...: the paired table (values side by side, spreads shown, no
percentages added together); and the regression gate against a baseline."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from .report import METRICS, fmt, wide_console
from .runner import fingerprint_errors

GATED = ("ttft_s", "step_p50_s", "task_s", "stream_tok_s", "aggregate_tok_s")


def key(cell: dict) -> tuple:
    return cell["context"], cell["concurrency"], cell["mode"]


def paired_table(results: list[dict], names: list[str], console: Console | None = None) -> None:
    console = console or wide_console()
    cells = {}
    for i, res in enumerate(results):
        for c in res["cells"]:
            cells.setdefault(key(c), [None] * len(results))[i] = c
    for metric, (label, scale, unit, _) in METRICS.items():
        t = Table(title=f"{label} {unit}".strip())
        t.add_column("context")
        t.add_column("conc")
        t.add_column("mode")
        for n in names:
            t.add_column(n, justify="right", overflow="fold")
        if len(results) == 2:
            t.add_column("B / A", justify="right", overflow="fold")
        for k in sorted(cells):
            row = cells[k]
            vals = [fmt(c.get(metric), scale) if c else "-" for c in row]
            extra = []
            if len(results) == 2:
                a, b = ((c or {}).get(metric) or {} for c in row)
                extra = [f"{b['mean'] / a['mean']:.3f}" if a.get("mean") and b.get("mean") else "-"]
            t.add_row(f"{k[0]:,}", str(k[1]), k[2], *vals, *extra)
        console.print(t)
    unanswered = [fingerprint_errors(r.get("fingerprint") or {}) for r in results]
    for res, n, missing in zip(results, names, unanswered):
        fp = (res.get("fingerprint") or {}).get("all", "")
        console.print(f"{n}: greedy fingerprint {fp[:16]}"
                      + (f" (NOT of outputs: {len(missing)} prompts not answered)" if missing else ""))
    fps = {(r.get("fingerprint") or {}).get("all") for r in results}
    console.print("greedy outputs: " + ("UNKNOWN: prompts not answered" if any(unanswered) or None in fps
                                         else "identical" if len(fps) == 1 else "DIFFERENT"))


class GateRefused(ValueError):
    pass


def gate(result: dict, baseline: dict, tolerance: float) -> list[str]:
    """Regressions beyond `tolerance` (0.05 = 5%) in the gated metrics, per cell."""
    for what in ("hardware", "settings"):
        # as JSON sees them: a fresh result holds tuples where a loaded one holds lists
        a, b = (json.loads(json.dumps(r["receipt"].get(what))) for r in (result, baseline))
        if what == "settings":
            a = {k: v for k, v in (a or {}).items() if k not in ("repeats", "label")}
            b = {k: v for k, v in (b or {}).items() if k not in ("repeats", "label")}
        if a != b:
            raise GateRefused(f"the baseline was measured with other {what}: {b!r} vs {a!r}")
    base = {key(c): c for c in baseline["cells"]}
    # the settings are the same, so a cell the baseline has and this run lacks was never
    # measured (an interrupted run): no evidence of no regression
    problems = [f"{k}: not measured in this run (interrupted?)" for k in base
                if k not in {key(c) for c in result["cells"]}]
    for c in result["cells"]:
        b = base.get(key(c))
        if b is None:
            continue
        for metric in GATED:
            now, then = (c.get(metric) or {}).get("mean"), (b.get(metric) or {}).get("mean")
            if not c["ttft_s"]["n"] and then is not None:  # measured before, not now: no request answered
                problems.append(f"{key(c)} {metric}: not measured ({len(c.get('errors') or [])} "
                                f"errors) vs baseline {then:.4g}")
                continue
            if now is None or then is None:
                continue
            lower_better = METRICS[metric][3]
            worse = now > then * (1 + tolerance) if lower_better else now < then * (1 - tolerance)
            if worse:
                problems.append(f"{key(c)} {metric}: {now:.4g} vs baseline {then:.4g} "
                                f"({'lower' if lower_better else 'higher'} is better)")
    return problems
