"""Start a vLLM OpenAI server process on this machine and talk to it: the vLLM CPU tier's
tests of every package and the benchmarks that need a server of their own. It does not
import vLLM: it runs the given vLLM interpreter."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def ephemeral_low(default: int = 32768) -> int:
    """Where the kernel's ephemeral port range starts (ports it gives outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: none is given twice


def free_port(span: int = 1) -> int:
    """A port nothing listens on (with span > 1: the first of that many in a row), for a
    server started next; never one this process was given before, since nothing binds a port
    between this check and its server's start. Chosen below the ephemeral range (and
    torch.distributed's 29500s): a port the kernel hands out (bind to 0) can be taken by any
    outgoing connection between this check and the server's own bind."""
    rng, high = random.SystemRandom(), min(ephemeral_low(), 29000)  # 29500+: torch.distributed's
    for _ in range(200 if high > 20100 + span else 0):
        port = rng.randrange(20000, high - span)
        ports = range(port, port + span)
        if not _HANDED_OUT.intersection(ports) and all(_bindable(p) for p in ports):
            _HANDED_OUT.update(ports)
            return port
    with socket.socket() as s:  # the range is crowded: let the kernel choose
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _HANDED_OUT.update(range(port, port + span))
    return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# One rank on one host: the model runner inside vLLM's engine-core process (vLLM's own choice
# on one GPU), one interpreter fewer to start than the worker process vLLM's CPU platform
# chooses. That platform keeps the in-process executor only with V1 multiprocessing off, which
# the API server ignores (its engine core still runs in a process of its own). One OpenMP
# thread and one numba thread (vLLM's n-gram proposer), left to the scheduler: the worker
# process would be bound to one core (the same core for every engine on the machine), and
# idle pool threads spin on cores every engine beside them needs.
ONE_PROCESS_ARGS = ["--distributed-executor-backend", "uni"]
ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


def vllm_command(python: str, model, port: int, spec: str | None = None,
                 kv_bytes: int = 1 << 30, name: str = "target", dtype: str = "float32",
                 max_model_len: int = 1024, eager: bool = True, host: str = "127.0.0.1",
                 extra: list[str] | None = None, one_process: bool = True) -> list[str]:
    """The OpenAI server's command line for one rank (VllmServer runs it, with ONE_PROCESS_ENV
    when `one_process`)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", name, "--max-model-len", str(max_model_len),
           "--dtype", dtype, "--host", host, "--port", str(port),
           "--kv-cache-memory-bytes", str(kv_bytes), *(ONE_PROCESS_ARGS if one_process else [])]
    cmd += ["--enforce-eager"] if eager else []
    return cmd + (["--speculative-config", spec] if spec else []) + (extra or [])


class VllmServer:
    """vLLM serving `model` as `name` (float32 and eager by default) with an explicit KV
    budget; `spec` is a --speculative-config JSON or None; `env` adds variables
    (REMOTE_DRAFTER_*, ENGRAM_* ...); `one_process=False`: the model runner in a worker
    process of its own, as on the Sparks' two ranks."""

    def __init__(self, python: str, model: Path, log: Path, spec: str | None = None,
                 env: dict | None = None, kv_bytes: int = 1 << 30, max_tokens: int = 24,
                 ready_timeout_s: float = 900, name: str = "target", dtype: str = "float32",
                 max_model_len: int = 1024, eager: bool = True, one_process: bool = True):
        self.port, self.log, self.max_tokens, self.name = free_port(), Path(log), max_tokens, name
        cmd = vllm_command(python, model, self.port, spec, kv_bytes, name, dtype, max_model_len,
                           eager, one_process=one_process)
        # the legacy VLLM_CPU_KVCACHE_SPACE would override the explicit KV budget
        full_env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        full_env.update({"HF_HUB_OFFLINE": "1", **(ONE_PROCESS_ENV if one_process else {}), **(env or {})})
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited: {self.log.read_text()[-4000:]}")
            try:
                self._get("/v1/models", 2)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(2)
        self.stop()
        raise RuntimeError(f"vLLM not ready in {ready_timeout_s:.0f} s: {self.log.read_text()[-4000:]}")

    def _get(self, path: str, timeout: float) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.read().decode()

    def complete(self, prompt: str, logprobs: int | None = None, max_tokens: int | None = None) -> dict:
        body = {"model": self.name, "prompt": prompt, "max_tokens": max_tokens or self.max_tokens,
                "temperature": 0, "return_token_ids": True}
        if logprobs:
            body["logprobs"] = logprobs
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["choices"][0]

    def kv_tokens(self) -> int:
        """The KV pool as vLLM reports it at start-up ('CPU KV cache size: N tokens')."""
        match = re.search(r"KV cache size: ([\d,]+) tokens", self.log.read_text())
        if not match:
            raise RuntimeError("vLLM did not report its KV cache size")
        return int(match.group(1).replace(",", ""))

    def spec_counter(self, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in self._get("/metrics", 10).splitlines()
                   if line.startswith(f"vllm:spec_decode_{name}_total"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
