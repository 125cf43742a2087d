"""longctx_bench: long-context measurements against any OpenAI-compatible server (TTFT,
SSE step timing, concurrency, cold/warm, capacity drills), A/B comparison and a
regression gate. Torch-free. Definitions: ARCHITECTURE.md § Measurements (and the README)."""

__version__ = "0.1.0"
