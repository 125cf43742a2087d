"""The measurement definitions (ARCHITECTURE.md § Measurements), as pure functions of the records.

* TTFT: request sent -> first content token event.
* Step time: gaps between consecutive token events of one request; p50 per request
  (and p10, p90: the spread).
  Tokens per event are reported beside it (speculative decoding puts several in one).
* Stream tok/s = (tokens - 1) / (last token - first token). Task time = sent -> last token.
* Aggregate tok/s = all tokens / (last token - first token) over the group.
* A cell reports mean +- sample standard deviation with the number of observations.
"""

from __future__ import annotations

import math

import numpy as np

from .sse import RequestRecord


def request_metrics(r: RequestRecord) -> dict | None:
    if r.error or not r.events:
        return None
    times = [t for t, _ in r.events]
    gaps = np.diff(times)
    span = times[-1] - times[0]
    return {
        "ttft_s": times[0] - r.sent,
        "step_p50_s": float(np.median(gaps)) if len(gaps) else None,
        # the spread, so a slow spell of a busy machine is not read as a result
        "step_p10_s": float(np.percentile(gaps, 10)) if len(gaps) else None,
        "step_p90_s": float(np.percentile(gaps, 90)) if len(gaps) else None,
        "tokens_per_event": r.tokens / len(r.events),
        "stream_tok_s": (r.tokens - 1) / span if span > 0 else None,
        "task_s": times[-1] - r.sent,
        "tokens": r.tokens,
    }


def group_metrics(records: list[RequestRecord]) -> dict:
    done = [r for r in records if not r.error and r.events]
    if not done:
        return {"aggregate_tok_s": None, "combined_decode_tok_s": None}
    first = min(r.events[0][0] for r in done)
    last = max(r.events[-1][0] for r in done)
    tokens = sum(r.tokens for r in done)
    rates = [m["stream_tok_s"] for m in map(request_metrics, done) if m and m["stream_tok_s"]]
    return {"aggregate_tok_s": tokens / (last - first) if last > first else None,
            "combined_decode_tok_s": float(sum(rates)) if rates else None}


def summarize(values: list) -> dict:
    """mean, sample sd and n of the values that exist (None are not observations)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not xs:
        return {"mean": None, "sd": None, "n": 0}
    sd = float(np.std(xs, ddof=1)) if len(xs) > 1 else None
    return {"mean": float(np.mean(xs)), "sd": sd, "n": len(xs)}


def percentiles(values: list, ps: list[float]) -> dict:
    xs = [v for v in values if v is not None]
    if not xs:
        return {}
    return {f"p{p:g}": float(np.percentile(xs, p)) for p in ps}


def spec_decode(before: dict, after: dict) -> dict | None:
    """Spec-decode counters differenced over a cell; mean accepted length = 1 + a / d."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    if not all(f"vllm:spec_decode_{k}" in after for k in keys):
        return None
    d = {k: after[f"vllm:spec_decode_{k}"] - before.get(f"vllm:spec_decode_{k}", 0.0) for k in keys}
    out = {**d, "mean_accepted_length": 1 + d["num_accepted_tokens"] / d["num_drafts"]
           if d["num_drafts"] else None}
    pos = {k.rsplit("=", 1)[1]: v - before.get(k, 0.0) for k, v in after.items()
           if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos|position=")}
    if pos and d["num_drafts"]:
        out["acceptance_per_position"] = {p: n / d["num_drafts"] for p, n in sorted(pos.items())}
    return out
