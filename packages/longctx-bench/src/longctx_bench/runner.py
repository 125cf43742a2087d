"""A run: a warm-up request, then for every (context, concurrency) cell `repeats` groups
of concurrent streamed requests, the server's counters scraped around each cell; a greedy
fingerprint of fixed prompts; an optional capacity drill."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from dataclasses import dataclass, field

import httpx

from . import metrics, server
from .prompts import PromptSource, digest, synthetic_text
from .sse import RequestRecord, stream_completion

FINGERPRINT_PROMPTS = ("The capital of France is", "def fibonacci(n):",
                       "Count from one to ten: one, two,")


@dataclass
class RunConfig:
    base_url: str
    model: str
    contexts: list[int]
    concurrency: list[int]
    repeats: int = 3
    output_len: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    extra_body: dict = field(default_factory=dict)
    cold: bool = True
    seed: int = 0
    request_timeout_s: float = 1800.0
    prompt_file: str | None = None
    tokenizer: str | None = None
    capacity_drill: tuple[int, int] | None = None  # (requests, context)
    percentile_metrics: tuple[str, ...] = ("ttft_s", "step_p50_s")
    metric_percentiles: tuple[float, ...] = (50.0, 99.0)
    fingerprint_tokens: int = 32
    label: str = ""


def body(cfg: RunConfig, ids: list[int], max_tokens: int, temperature: float) -> dict:
    return {"model": cfg.model, "prompt": ids, "max_tokens": max_tokens,
            "temperature": temperature, "top_p": cfg.top_p, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True,
            **cfg.extra_body}


async def prompt_source(client: httpx.AsyncClient, cfg: RunConfig) -> PromptSource:
    longest = max(cfg.contexts + ([cfg.capacity_drill[1]] if cfg.capacity_drill else []))
    text = open(cfg.prompt_file).read() if cfg.prompt_file else synthetic_text(longest, cfg.seed)
    ids = await server.tokenize(client, cfg.base_url, cfg.model, text)
    if ids is None:
        if not cfg.tokenizer:
            raise RuntimeError("the server has no /tokenize: pass --tokenizer tokenizer.json")
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(cfg.tokenizer).encode(text, add_special_tokens=False).ids
    while len(ids) < longest:  # a short prompt file repeats
        ids = ids + ids
    return PromptSource(ids, cfg.seed)


async def one_group(client, cfg, prompts: list[list[int]], context: int) -> list[RequestRecord]:
    url = f"{cfg.base_url}/v1/completions"
    return list(await asyncio.gather(*[
        stream_completion(client, url, body(cfg, p, cfg.output_len, cfg.temperature),
                          RequestRecord(context), cfg.request_timeout_s) for p in prompts]))


async def run_cell(client, cfg: RunConfig, source: PromptSource, context: int, conc: int,
                   on_group=None) -> dict:
    warmup = (await one_group(client, cfg, [source.make(context, cold=True)], context))[0]
    before, _ = await server.scrape(client, cfg.base_url)
    warm_prompt = None if cfg.cold else source.make(context, cold=True)
    if warm_prompt is not None:  # the prompt the cell re-sends, cached once first
        await one_group(client, cfg, [warm_prompt], context)
    groups, prompt_digests = [], set()
    for _ in range(cfg.repeats):
        prompts = [source.make(context, cold=True) if cfg.cold else warm_prompt
                   for _ in range(conc)]
        prompt_digests.update(digest(p) for p in prompts)
        records = await one_group(client, cfg, prompts, context)
        groups.append(records)
        if on_group:
            on_group()
    after, info = await server.scrape(client, cfg.base_url)
    per_request = [metrics.request_metrics(r) for g in groups for r in g]
    ok = [m for m in per_request if m]
    cell = {"context": context, "concurrency": conc, "mode": "cold" if cfg.cold else "warm",
            "requests": [r.to_json() for g in groups for r in g],
            "errors": [r.error for g in groups for r in g if r.error],
            "checks": [c for g in groups for r in g for c in r.checks],
            "prompt_sha256": sorted(prompt_digests), "warmup_error": warmup.error}
    for key in ("ttft_s", "step_p50_s", "step_p10_s", "step_p90_s", "tokens_per_event",
                "stream_tok_s", "task_s"):
        cell[key] = metrics.summarize([m[key] for m in ok])
    cell["percentiles"] = {key: metrics.percentiles([m[key] for m in ok], cfg.metric_percentiles)
                           for key in cfg.percentile_metrics}
    gm = [metrics.group_metrics(g) for g in groups]
    cell["aggregate_tok_s"] = metrics.summarize([g["aggregate_tok_s"] for g in gm])
    cell["combined_decode_tok_s"] = metrics.summarize([g["combined_decode_tok_s"] for g in gm])
    cell["cached_tokens"] = [((r.usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
                             for g in groups for r in g]
    cell["spec_decode"] = metrics.spec_decode(before, after)
    cell["kv_usage"] = after.get("vllm:kv_cache_usage_perc", after.get("vllm:gpu_cache_usage_perc"))
    cell["kv_capacity_tokens"] = server.kv_capacity_tokens(info)
    return cell


EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()  # a prompt answered with no output at all


def fingerprint_errors(fp: dict) -> dict:
    """The fingerprint's prompts that got no greedy output: an error (kept in place of its
    digest) or nothing at all. A fingerprint with any is no fingerprint of outputs."""
    return {prompt: "no output" if value == EMPTY_DIGEST else value for prompt, value in fp.items()
            if prompt != "all" and (value == EMPTY_DIGEST or not re.fullmatch(r"[0-9a-f]{64}", str(value)))}


def failed_cells(result: dict) -> list[str]:
    """The cells in which no request was answered (context x concurrency, and why)."""
    return [f"{c['context']} x {c['concurrency']}: no request answered"
            + (f" (first error: {c['errors'][0]})" if c["errors"] else "")
            for c in result["cells"] if not c["ttft_s"]["n"]]


async def fingerprint(client, cfg: RunConfig) -> dict:
    """SHA-256 over the greedy tokens of fixed prompts: equal across configurations that
    produce identical outputs."""
    out = {}
    for text in FINGERPRINT_PROMPTS:
        ids = await server.tokenize(client, cfg.base_url, cfg.model, text)
        prompt = ids if ids is not None else text
        rec = await stream_completion(
            client, f"{cfg.base_url}/v1/completions",
            {**body(cfg, prompt, cfg.fingerprint_tokens, 0.0), "top_p": 1.0},
            RequestRecord(0), cfg.request_timeout_s)
        out[text] = rec.error or hashlib.sha256(
            ",".join(map(str, rec.token_ids)).encode() if rec.token_ids else rec.text.encode()
        ).hexdigest()
    out["all"] = hashlib.sha256("|".join(out[t] for t in FINGERPRINT_PROMPTS).encode()).hexdigest()
    return out


async def capacity_drill(client, cfg: RunConfig, source: PromptSource) -> dict:
    n, context = cfg.capacity_drill
    t = time.perf_counter()
    records = await one_group(client, cfg, [source.make(context, cold=True) for _ in range(n)],
                              context)
    return {"requests": n, "context": context, "all_completed": all(
        not r.error and r.finish_reason for r in records),
        "wall_s": time.perf_counter() - t,
        "per_request": [{"completed": not r.error and bool(r.finish_reason), "error": r.error,
                         "task_s": (r.events[-1][0] - r.sent) if r.events else None,
                         "tokens": r.tokens} for r in records]}


async def run(cfg: RunConfig, progress=None) -> dict:
    """Every cell; on cancellation (Ctrl-C) what was measured so far, marked partial."""
    limits = httpx.Limits(max_connections=max(cfg.concurrency + [1]) + 8)
    result = {"cells": [], "partial": False}
    async with httpx.AsyncClient(limits=limits, timeout=cfg.request_timeout_s) as client:
        result["server_models"] = await server.models(client, cfg.base_url)
        if "error" in result["server_models"]:  # not an OpenAI-compatible server there, or none
            raise RuntimeError(f"{cfg.base_url}/v1/models: {result['server_models']['error']} "
                               "(is the server up, and --base-url its address?)")
        _, info = await server.scrape(client, cfg.base_url)
        result["kv_capacity_tokens"] = server.kv_capacity_tokens(info)
        result["cache_config_info"] = info
        try:
            source = await prompt_source(client, cfg)
            result["fingerprint"] = await fingerprint(client, cfg)
            for context in cfg.contexts:
                for conc in cfg.concurrency:
                    cell = await run_cell(client, cfg, source, context, conc,
                                          progress.advance if progress else None)
                    result["cells"].append(cell)
            if cfg.capacity_drill:
                result["capacity_drill"] = await capacity_drill(client, cfg, source)
        except (asyncio.CancelledError, KeyboardInterrupt):
            result["partial"] = True
    return result
