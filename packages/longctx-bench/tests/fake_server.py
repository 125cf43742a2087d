"""A scripted OpenAI-compatible SSE server for the tests: events at controlled times and
token counts, /tokenize, /metrics with spec-decode counters, and scripted failures."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Script:
    def __init__(self, ttft_s=0.05, gaps_s=(0.02,) * 4, tokens_per_event=(1, 1, 2, 1, 3),
                 drafts_per_request=4, accepted_per_request=6):
        self.ttft_s, self.gaps_s, self.tokens_per_event = ttft_s, gaps_s, tokens_per_event
        self.drafts_per_request = drafts_per_request
        self.accepted_per_request = accepted_per_request


class FakeServer:
    def __init__(self, script: Script | None = None):
        self.script = script or Script()
        self.behaviors: deque[str] = deque()  # consumed one per completion: ok, malformed, drop, http500
        self.seen_prefixes: set[tuple] = set()
        self.counters = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
        self.lock = threading.Lock()
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def send_json(self, obj, status=200):
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path == "/v1/models":
                    return self.send_json({"object": "list", "data": [{"id": "fake-model"}]})
                if self.path == "/metrics":
                    body = fake.metrics_text().encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_json({"error": "not found"}, 404)

            def do_POST(self):  # noqa: N802
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    words = req["prompt"].split()
                    return self.send_json({"tokens": [10 + sum(map(ord, w)) % 500 for w in words],
                                           "count": len(words)})
                if self.path == "/v1/completions":
                    return fake.complete(self, req)
                self.send_json({"error": "not found"}, 404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def metrics_text(self) -> str:
        with self.lock:
            c = dict(self.counters)
        lines = ['vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0',
                 "vllm:kv_cache_usage_perc 0.25"]
        for k, v in c.items():
            lines += [f"# TYPE vllm:spec_decode_{k} counter", f"vllm:spec_decode_{k}_total {v}"]
        return "\n".join(lines) + "\n"

    def complete(self, h, req):
        with self.lock:
            behavior = self.behaviors.popleft() if self.behaviors else "ok"
            self.requests.append(req)
            prompt = req["prompt"]
            prefix = tuple(prompt[:16]) if isinstance(prompt, list) else (prompt,)
            cached = len(prompt) // 16 * 16 if prefix in self.seen_prefixes else 0
            self.seen_prefixes.add(prefix)
        if behavior == "http500":
            return h.send_json({"error": "boom"}, 500)
        s = self.script
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def send(data: str):
            raw = f"data: {data}\n\n".encode()
            h.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
            h.wfile.flush()

        time.sleep(s.ttft_s)
        tok = 100
        for i, n in enumerate(s.tokens_per_event):
            if i:
                time.sleep(s.gaps_s[i - 1])
            if behavior == "drop" and i == 2:
                h.wfile.flush()
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)  # a FIN now, mid-stream
                return
            if behavior == "malformed" and i == 2:
                send("{not json")
                continue
            ids = list(range(tok, tok + n))
            tok += n
            send(json.dumps({"choices": [{"index": 0, "text": " w" * n, "token_ids": ids,
                                          "finish_reason": None}]}))
        total = sum(s.tokens_per_event)
        # counted before the stream ends, as vLLM counts a request's drafts in its steps: a
        # scrape after the client saw [DONE] always includes them
        with self.lock:
            self.counters["num_drafts"] += s.drafts_per_request
            self.counters["num_draft_tokens"] += s.drafts_per_request * 3
            self.counters["num_accepted_tokens"] += s.accepted_per_request
        send(json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
        send(json.dumps({"choices": [], "usage": {
            "prompt_tokens": len(prompt), "completion_tokens": total,
            "prompt_tokens_details": {"cached_tokens": cached}}}))
        send("[DONE]")
        h.wfile.write(b"0\r\n\r\n")

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
