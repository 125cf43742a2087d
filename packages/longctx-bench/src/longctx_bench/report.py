"""Results: the JSON (every observation plus a receipt), the terminal table, the plots."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess

from rich.console import Console
from rich.table import Table

from . import __version__

LOG_WIDTH = 240  # columns of a table written to a file or a pipe

METRICS = {  # name -> (label, unit scale, unit, lower is better)
    "ttft_s": ("TTFT", 1e3, "ms", True),
    "step_p50_s": ("step p50", 1e3, "ms", True),
    "tokens_per_event": ("tok/event", 1, "", False),
    "stream_tok_s": ("stream tok/s", 1, "", False),
    "task_s": ("task", 1, "s", True),
    "aggregate_tok_s": ("aggregate tok/s", 1, "", False),
}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def receipt(settings: dict, hardware: str) -> dict:
    return {"tool": "longctx-bench", "version": __version__, "git_commit": git_commit(),
            "time": datetime.datetime.now(datetime.UTC).isoformat(),
            "client_host": platform.node(), "hardware": hardware, "settings": settings}


def fmt(stat: dict, scale: float, with_n: bool = True) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    sd = f"±{stat['sd'] * scale:.2f}" if stat.get("sd") is not None else ""
    return f"{stat['mean'] * scale:.2f}{sd}" + (f" (n={stat['n']})" if with_n else "")


def wide_console(stderr: bool = False) -> Console:
    """A console whose tables keep every digit: a terminal's own width, else (a file, a
    pipe, a CI log) one wide enough for the widest table, not rich's 80 columns."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=LOG_WIDTH)


def print_table(result: dict, console: Console | None = None) -> None:
    console = console or wide_console()
    t = Table(title=f"longctx-bench {result.get('label') or ''} (mean±sd over n requests; "
                    "aggregate over groups)".strip())
    for col in ("context", "conc", "mode", "n", *[f"{m[0]} {m[2]}".strip() for m in METRICS.values()],
                "acc. len", "errors"):
        t.add_column(col, justify="right", overflow="fold")  # a narrow terminal folds, never cuts
    for c in result["cells"]:
        sd = c.get("spec_decode") or {}
        mal = sd.get("mean_accepted_length")
        t.add_row(f"{c['context']:,}", str(c["concurrency"]), c["mode"], str(c["ttft_s"]["n"]),
                  *[fmt(c.get(k), m[1], with_n=False) for k, m in METRICS.items()],
                  f"{mal:.2f}" if mal else "-", str(len(c["errors"])))
    console.print(t)
    for c in result["cells"]:
        pcts = "; ".join(f"{m} " + " ".join(f"{p}={v * (1e3 if m.endswith('_s') else 1):.1f}"
                                             for p, v in vals.items())
                         for m, vals in (c.get("percentiles") or {}).items() if vals)
        if pcts:
            console.print(f"{c['context']:,} x {c['concurrency']}: {pcts}"
                          " (ms for times)")
    if result.get("capacity_drill"):
        d = result["capacity_drill"]
        console.print(f"capacity drill: {d['requests']} x {d['context']:,} tokens -> "
                      f"{'all completed' if d['all_completed'] else 'NOT all completed'} "
                      f"in {d['wall_s']:.1f} s")
    if result.get("fingerprint"):
        console.print(f"greedy fingerprint: {result['fingerprint']['all'][:16]}")


def save(result: dict, result_dir: str, name: str) -> str:
    os.makedirs(result_dir, exist_ok=True)
    path = os.path.join(result_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def plot(results: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for res in results:
        label = res.get("label") or res["receipt"]["time"][:19]
        for ax, key, scale in ((axes[0], "ttft_s", 1e3), (axes[1], "step_p50_s", 1e3)):
            for conc in sorted({c["concurrency"] for c in res["cells"]}):
                cells = sorted((c for c in res["cells"] if c["concurrency"] == conc
                                and (c.get(key) or {}).get("mean") is not None),
                               key=lambda c: c["context"])
                if cells:
                    ax.errorbar([c["context"] for c in cells],
                                [c[key]["mean"] * scale for c in cells],
                                yerr=[(c[key]["sd"] or 0) * scale for c in cells],
                                marker="o", capsize=3, label=f"{label} c={conc}")
    for ax, title in ((axes[0], "TTFT (ms)"), (axes[1], "step p50 (ms)")):
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
