"""The drafter worker: a DraftService behind an ofl server. The handshake metadata carries
the identity manifest and the drafter's limits; rounds are ofl messages, each handled for
the peer address the server saw at accept (whose quota it charges); a background thread
releases idle requests. Closed by default, as ofl servers are: on an address other hosts
can reach the server needs OFL_ALLOW or a shared key, or `insecure`."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

from ofl import Server
from remote_drafter.models.base import Drafter

from .service import DraftService, ServiceConfig

log = logging.getLogger("remote_drafter.worker.server")


class Worker:
    def __init__(self, drafter: Drafter, backend: str = "tcp", host: str = "127.0.0.1",
                 port: int = 0, config: ServiceConfig | None = None,
                 identity: str = "remote-drafter-worker", insecure: bool | None = None):
        """`insecure`: admit any peer on an exposed address with neither allow-list nor key
        (None: OFL_INSECURE); without it such an address raises ofl's ConfigurationError."""
        self.service = DraftService(drafter, config)
        try:
            self.server = Server(backend, host, port, identity=identity, handler=self.service.handle,
                                 metadata={"remote_drafter": self.service.describe()},
                                 insecure=insecure)
        except BaseException:
            self.service.close()
            raise
        self.service.max_reply_bytes = self.server.max_message_bytes  # larger replies are refused whole
        self.service.admission = self.server.admission_status()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="idle-sweeper", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server.address
        return f"{host}:{port}"

    def start(self) -> Worker:
        self.warm_up_s = self.service.warm_up()  # before accepting anyone
        self.server.start()
        self._sweeper.start()
        return self

    def _sweep(self) -> None:
        while not self._stop.wait(self.service.config.expiry_interval_s):
            self.service.expire_idle()

    def stop(self) -> None:
        """No new rounds; returns once the round in flight, if any, has finished."""
        self._stop.set()
        self.server.stop()
        with self.service.device_lock:
            pass
        self.service.close()

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def spawn_worker(args: list[str], env: dict | None = None, stderr=None) -> tuple[subprocess.Popen, str]:
    """Start `remote-drafter worker ARGS` as a process; return it and its address once it
    serves (the benchmark's and the tests' workers)."""
    proc = subprocess.Popen([sys.executable, "-m", "remote_drafter.cli", "worker", *args],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    line = proc.stdout.readline()
    if "remote-drafter worker:" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"worker did not start: {line!r}")
    return proc, line.rsplit(" on ", 1)[1].strip()
