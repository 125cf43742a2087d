import os
import signal
import subprocess
import sys
import time

import pytest

from ofl.cli import start_loopback_server


class ServeProcess:
    """A real `ofl serve` process (pattern region + echo handler) on 127.0.0.1."""

    def __init__(self, backend: str, size: int = 8 << 20):
        self.backend = backend
        self.size = size
        self.proc, self.address = start_loopback_server(backend, size)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def restart(self) -> None:
        """Kill and start again on the same port (a server restart)."""
        self.kill()
        deadline = time.monotonic() + 10
        while True:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ofl.cli", "serve", "--backend", self.backend, "--listen",
                 self.address, "--size", str(self.size)], stdout=subprocess.PIPE, text=True)
            line = proc.stdout.readline()
            if "ofl serve:" in line:
                self.proc = proc
                return
            proc.wait()
            if time.monotonic() > deadline:
                raise RuntimeError("server did not restart on its port")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

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
def served(request):
    srv = ServeProcess(request.param)
    yield srv
    srv.stop()
