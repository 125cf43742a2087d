import os
import signal
import subprocess
import sys

import pytest

from remote_engram.geometry import EngramGeometry
from remote_engram.synth import write_shards

# A small table with the real structure: layers 1 and 14, orders 2-4, 8 heads, primes > 1000.
SMALL = EngramGeometry(layers=(1, 14), vocab=500, prime_start=1000)


@pytest.fixture(scope="session")
def shard_dirs(tmp_path_factory):
    """Two table sets of the same geometry: seed 0 (the real one) and seed 1 (different)."""
    base = tmp_path_factory.mktemp("engram")
    dirs = {}
    for seed in (0, 1):
        d = str(base / f"seed{seed}")
        write_shards(d, SMALL, nranks=2, seed=seed)
        dirs[seed] = d
    return dirs


class EngramServeProcess:
    """A real `remote-engram serve` process on 127.0.0.1."""

    def __init__(self, shard_dir: str, backend: str, port: int = 0):
        self.shard_dir, self.backend = shard_dir, backend
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "remote_engram.cli", "serve", "--shards", shard_dir,
             "--backend", backend, "--listen", f"127.0.0.1:{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()
        if "remote-engram serve:" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r}")
        self.address = line.rsplit(" on ", 1)[1].strip()

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(params=["tcp", "shm"])
def engram_server(request, shard_dirs):
    srv = EngramServeProcess(shard_dirs[0], request.param)
    yield srv
    srv.stop()
