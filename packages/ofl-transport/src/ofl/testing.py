"""Test helpers other packages' suites share: a real `ofl serve` process, two "hosts" in
network namespaces joined by veth pairs, one pair per link (like the offload host and the
Sparks; needs root), and a small tmpfs (a container's /dev/shm; needs root)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def sh(*cmd, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
    """cmd run to its exit (within `timeout` s), its output (text) read from files, not pipes:
    the wait is for the process alone, so a pipe another process still holds (one the
    command started in a namespace, say) cannot keep it waiting."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code = subprocess.run(cmd, stdout=out, stderr=err, timeout=timeout, **kw).returncode
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(cmd, code, out.read().decode(), err.read().decode())
    if check:
        done.check_returncode()
    return done


def netns_unavailable() -> str | None:
    """None where `ip netns` works here, else the reason (for a pytest skip)."""
    probe = f"oflp{os.getpid() % 100000}"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "del", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns not permitted here ({exc}); the root CI machine runs it"
    return None


@contextlib.contextmanager
def small_shm(parent, size: str = "1m"):
    """ofl.region.SHM_DIR on a fresh tmpfs of `size` (mount's spelling) at parent/shm for the
    block, as a container's small /dev/shm; yields that folder. Mounting needs root: elsewhere
    the test is skipped, saying so."""
    import pytest  # a test's helper: pytest is there

    from . import region
    folder = os.path.join(str(parent), "shm")
    os.makedirs(folder, exist_ok=True)
    try:
        sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"mounting a tmpfs needs root ({exc}); tools/test runs as root on the CI machine")
    saved, region.SHM_DIR = region.SHM_DIR, folder
    try:
        yield folder
    finally:
        region.SHM_DIR = saved
        sh("umount", "-l", folder)  # lazily: a mapping a failed test left must not hide its failure


class TwoHosts:
    """Namespaces `host` and `engine`, link i = veth pair with 10.23{i}.0.1 (host side) and
    10.23{i}.0.2 (engine side). Addresses exist only inside these namespaces."""

    def __init__(self, links: int = 2, mtu: int = 9000):
        tag = f"{os.getpid() % 100000}"
        self.host, self.engine = f"oflh{tag}", f"ofle{tag}"
        self.links = [(f"10.23{i}.0.1", f"10.23{i}.0.2") for i in range(links)]
        self.host_dev = [f"oh{i}{tag}" for i in range(links)]
        self.engine_dev = [f"oe{i}{tag}" for i in range(links)]
        self.mtu = mtu

    def __enter__(self) -> TwoHosts:
        sh("ip", "netns", "add", self.host)
        sh("ip", "netns", "add", self.engine)
        try:
            for i, (host_ip, engine_ip) in enumerate(self.links):
                h, e = self.host_dev[i], self.engine_dev[i]
                sh("ip", "link", "add", h, "type", "veth", "peer", "name", e)
                sh("ip", "link", "set", h, "netns", self.host)
                sh("ip", "link", "set", e, "netns", self.engine)
                for ns, dev, ip in ((self.host, h, host_ip), (self.engine, e, engine_ip)):
                    sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                    sh("ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu), "up")
            for ns in (self.host, self.engine):
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        sh("ip", "netns", "del", self.host, check=False)
        sh("ip", "netns", "del", self.engine, check=False)

    def popen_host(self, args: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start a process on the host side (e.g. a server); its servers admit the engine
        side's addresses (OFL_ALLOW), as a deployment's allow-list does."""
        allow = {"OFL_ALLOW": ",".join(engine_ip for _, engine_ip in self.links)}
        return subprocess.Popen(["ip", "netns", "exec", self.host, *args],
                                env={**os.environ, **allow, **(env or {})}, **kw)

    def run_engine(self, args: list[str], check=False) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.engine, *args, check=check)

    def python_engine(self, code: str) -> subprocess.CompletedProcess:
        import textwrap

        return self.run_engine([sys.executable, "-c", textwrap.dedent(code)])

    def set_link(self, i: int, up: bool) -> None:
        sh("ip", "-n", self.engine, "link", "set", self.engine_dev[i], "up" if up else "down")

    def rx_bytes(self, i: int) -> int:
        """Bytes the engine side of link i received, read over netlink by `ip -n` itself (no
        second program in the namespace)."""
        out = sh("ip", "-n", self.engine, "-s", "-j", "link", "show", "dev", self.engine_dev[i]).stdout
        link = json.loads(out)[0]
        return int(link.get("stats64", link.get("stats"))["rx"]["bytes"])  # older iproute2: "stats"


class ChildProcess:
    """A server process a test started: stop() (even when SIGSTOPped) and kill(). stop()
    waits `grace_s` for it to exit on SIGTERM before killing it."""

    proc: subprocess.Popen
    grace_s = 10.0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ServeProcess(ChildProcess):
    """A real `ofl serve` process (pattern region + echo handler) on 127.0.0.1; `env` adds
    variables to its environment, `stderr` is where its log goes (a file to read it)."""

    def __init__(self, backend: str, size: int = 8 << 20, env: dict | None = None, stderr=None):
        self.backend = backend
        self.size = size
        from .cli import start_loopback_server

        self.popen = {"env": {**os.environ, **(env or {})}, "stderr": stderr}
        self.proc, self.address = start_loopback_server(backend, size, **self.popen)

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
                 self.address, "--size", str(self.size)], stdout=subprocess.PIPE, text=True,
                **self.popen)
            line = proc.stdout.readline()
            if "ofl serve:" in line:
                self.proc = proc
                return
            proc.wait()
            if time.monotonic() > deadline:
                raise RuntimeError("server did not restart on its port")
            time.sleep(0.1)


def link_delay(seconds: float, spin_s: float = 1e-3) -> None:
    """A simulated link's delay, exact to a few microseconds: sleep most of it, spin the
    rest (a plain sleep overshoots by a wake-up, which a benchmark would count as the
    link's)."""
    end = time.perf_counter() + seconds
    if seconds > spin_s:
        time.sleep(seconds - spin_s)
    while time.perf_counter() < end:
        pass


def wait_until(read, until=bool, what: str = "the awaited event", timeout_s: float = 10.0,
               interval_s: float = 0.005):
    """Poll `read()` until `until(value)` holds and return that value: tests and fault drills
    wait on an observed event (a counter, a thread count, a pid), never on a sleep. Bounded:
    AssertionError naming `what` and the last value seen after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not until(value := read()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not observed in {timeout_s:g} s: {what} (last: {value!r})")
        time.sleep(interval_s)
    return value


def closes(sock: socket.socket) -> bool:
    """Read until the server closes (or resets) the connection; False if it still holds it
    when the socket's timeout passes."""
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def http_status(sock: socket.socket) -> int:
    """The status code of the reply an HTTP server sent before it closed the connection."""
    reply = b""
    try:
        while chunk := sock.recv(4096):
            reply += chunk
    except ConnectionResetError:
        pass  # it closed with the rest of our request unread: the reply came first
    return int(reply.split(b" ", 2)[1])


def threads(pid: int) -> int:
    """How many threads process `pid` runs now."""
    return len(os.listdir(f"/proc/{pid}/task"))


def rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"process {pid} reports no VmRSS")


def stop_process(pid: int) -> None:
    """SIGSTOP and wait until the kernel reports every thread stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s == "T" for s in states):
            return
        time.sleep(0.01)
    raise RuntimeError(f"process {pid} did not stop")
