"""What the bench asks a server besides completions: /v1/models, /tokenize, /metrics."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

WATCHED = ("vllm:spec_decode_", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
           "vllm:num_requests_running", "vllm:prompt_tokens", "vllm:generation_tokens")


async def models(client: httpx.AsyncClient, base: str) -> dict:
    try:
        r = await client.get(f"{base}/v1/models", timeout=10)
        return r.json() if r.status_code == 200 else {"error": f"HTTP {r.status_code}"}
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": str(exc)}


async def tokenize(client: httpx.AsyncClient, base: str, model: str, text: str) -> list[int] | None:
    """Token ids from the server's /tokenize (vLLM), or None when it has none."""
    try:
        r = await client.post(f"{base}/tokenize", json={"model": model, "prompt": text,
                                                         "add_special_tokens": False}, timeout=60)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    tokens = r.json().get("tokens")
    return tokens if isinstance(tokens, list) else None


async def scrape(client: httpx.AsyncClient, base: str) -> tuple[dict, dict]:
    """(samples, info): counter/gauge values keyed 'name' or 'name|label=value', and the
    labels of vllm:cache_config_info. Empty when the server exposes no /metrics."""
    try:
        r = await client.get(f"{base}/metrics", timeout=10)
    except httpx.HTTPError:
        return {}, {}
    if r.status_code != 200:
        return {}, {}
    samples, info = {}, {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.startswith("vllm:cache_config_info"):
                info = dict(s.labels)
                continue
            if not s.name.startswith(WATCHED) or s.name.endswith("_created"):
                continue
            name = s.name.removesuffix("_total")  # counters compare under one name
            key = name
            if "position" in s.labels:
                key = f"{name}|position={s.labels['position']}"
            samples[key] = samples.get(key, 0.0) + s.value  # summed over engines/models
    return samples, info


def kv_capacity_tokens(info: dict) -> int | None:
    """KV pool in tokens: the `kv_cache_size_tokens` label (vLLM 0.32+) or blocks x size."""
    try:
        return int(info["kv_cache_size_tokens"])
    except (KeyError, ValueError, TypeError):
        pass
    try:
        return int(info["num_gpu_blocks"]) * int(info["block_size"])
    except (KeyError, ValueError, TypeError):
        return None
