"""One streamed completion: send, timestamp every SSE event, count its tokens.

Tokens per event come from `token_ids` in each chunk (vLLM's `return_token_ids`), else
from `logprobs.tokens`, else each content event counts as one token (the record says
which). Errors - HTTP status, malformed SSE, a dropped connection - are recorded on the
request; they never abort the run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class RequestRecord:
    context_tokens: int
    sent: float = 0.0                     # perf_counter at send
    events: list = field(default_factory=list)   # [(t, tokens)] per content event
    token_ids: list = field(default_factory=list)
    text: str = ""
    usage: dict = field(default_factory=dict)
    token_count_source: str = "events"
    finish_reason: str | None = None
    error: str | None = None
    checks: list = field(default_factory=list)   # problems found (empty output, count mismatch)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)

    def to_json(self) -> dict:
        d = asdict(self)
        d["events"] = [[round(t - self.sent, 6), n] for t, n in self.events]
        return d


def event_tokens(choice: dict) -> tuple[int, list, str]:
    """(token count, token ids, source) of one streamed choice."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids), ids, "token_ids"
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"]), [], "logprobs"
    delta = choice.get("text")
    if delta is None:
        delta = (choice.get("delta") or {}).get("content")
    return (1 if delta else 0), [], "events"


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict,
                            record: RequestRecord, timeout_s: float) -> RequestRecord:
    record.sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                record.error = f"HTTP {resp.status_code}: {text}"
                return record
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    record.error = f"malformed SSE data: {data[:120]!r}"
                    return record
                if chunk.get("usage"):
                    record.usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    n, ids, source = event_tokens(choice)
                    if n:
                        record.events.append((now, n))
                        record.token_ids += ids
                        record.token_count_source = source
                        record.text += choice.get("text") or (choice.get("delta") or {}).get(
                            "content") or ""
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    completion = record.usage.get("completion_tokens")
    if not record.events:
        record.checks.append("empty output")
    elif completion is not None and record.token_count_source != "events" \
            and completion != record.tokens:
        record.checks.append(f"completion_tokens {completion} != {record.tokens} tokens received")
    if "nan" in record.text.lower().split():
        record.checks.append("NaN in output")
    return record
