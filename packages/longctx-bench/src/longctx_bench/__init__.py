"""longctx_bench: long-context measurements against any OpenAI-compatible server (TTFT,
SSE step timing, concurrency, cold/warm, capacity drills), A/B comparison and a
regression gate. Torch-free. Definitions: DESIGN.md section 5 (and the README)."""

__version__ = "0.1.0"
