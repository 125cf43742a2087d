"""Test helpers the remote-engram tests and benchmarks share (as `ofl.testing` is ofl's): a
small table geometry with the real structure and a real `remote-engram serve` process."""

from __future__ import annotations

import os
import subprocess
import sys

from ofl.testing import ChildProcess

from .geometry import EngramGeometry

# A small table with the real structure: layers 1 and 14, orders 2-4, 8 heads, primes > 1000.
SMALL = EngramGeometry(layers=(1, 14), vocab=500, prime_start=1000)


class EngramServeProcess(ChildProcess):
    """A real `remote-engram serve` process on `host` (127.0.0.1); `metrics_listen` adds its
    HTTP endpoint, `flags` more serve flags (--insecure), `env` variables to its environment,
    `stderr` is where its log goes."""

    def __init__(self, shard_dir: str, backend: str, port: int = 0, links: int = 1,
                 delay_ms: float = 0.0, metrics_listen: str | None = None,
                 env: dict | None = None, stderr=subprocess.DEVNULL, host: str = "127.0.0.1",
                 flags: tuple[str, ...] = ()):
        self.shard_dir, self.backend = shard_dir, backend
        listen = [arg for i in range(links) for arg in ("--listen", f"{host}:{port if not i else 0}")]
        metrics = ["--metrics-listen", metrics_listen] if metrics_listen else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "remote_engram.cli", "serve", "--shards", shard_dir,
             "--backend", backend, "--inject-delay-ms", str(delay_ms), *listen, *metrics, *flags],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if "remote-engram serve:" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r}")
        self.addresses = line.rsplit(" on ", 1)[1].strip().split(", ")
        self.address = self.addresses[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])
