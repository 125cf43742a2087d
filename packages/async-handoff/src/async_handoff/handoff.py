"""Handoff: the engine side. submit() and poll() never block; wait() blocks at most
max_wait. A watchdog thread respawns a dead or stuck proxy, at most R times per window W;
past that the handoff stays disabled (the caller decodes without drafts) and says so.

    h = Handoff(HandoffConfig.from_env(), "async_handoff.adapters:OflMessageAdapter",
                {"address": "10.0.0.2:7490", "backend": "tcp"}).start()
    t = h.submit(request)           # at step k: returns at once (None: no round this step)
    reply = h.poll(t)               # at step k+1: the reply, or None -> no drafts this step
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ofl import region as shm_files
from ofl.env import EnvVar

from . import env
from ._hostflags import lib
from .hostflags import (
    PROXY_FAILED,
    PROXY_READY,
    WAIT_MODES,
    HostFlags,
    HostFlagsError,
    Ticket,
)

log = logging.getLogger("async_handoff")
REGION_PREFIX = "async-handoff-"  # the engine's host-flags regions in /dev/shm
# reasons a disabled handoff gives that the watchdog leaves as they are (no respawns)
RESPAWN_BOUND, NO_REGION = "respawn bound", "no host-flags region"


def env_field(var: EnvVar, kind: type = str):
    """A field that from_env() reads from `var`; its default is var's declared default, so
    env.py is the one source of both."""
    return field(default=kind(var.default), metadata={"env": var, "kind": kind})


@dataclass
class HandoffConfig:
    mode: str = env_field(env.ASYNC_HANDOFF_WAIT_MODE)
    spin_us: float = env_field(env.ASYNC_HANDOFF_SPIN_US, float)
    slots: int = env_field(env.ASYNC_HANDOFF_SLOTS, int)
    slot_bytes: int = env_field(env.ASYNC_HANDOFF_SLOT_BYTES, int)
    round_deadline_ms: float = env_field(env.ASYNC_HANDOFF_ROUND_DEADLINE_MS, float)
    max_wait_ms: float = env_field(env.ASYNC_HANDOFF_MAX_WAIT_MS, float)
    heartbeat_timeout_ms: float = env_field(env.ASYNC_HANDOFF_HEARTBEAT_TIMEOUT_MS, float)
    respawn_max: int = env_field(env.ASYNC_HANDOFF_RESPAWN_MAX, int)
    respawn_window_s: float = env_field(env.ASYNC_HANDOFF_RESPAWN_WINDOW_S, float)
    startup_timeout_s: float = env_field(env.ASYNC_HANDOFF_STARTUP_TIMEOUT_S, float)
    proxy_cpus: str = env_field(env.ASYNC_HANDOFF_PROXY_CPUS)
    watchdog_interval_s: float = 0.05
    proxy_env: dict = field(default_factory=dict)  # extra environment for the proxy
    # HOST:PORT serving the counters to other processes (exposition)
    metrics_listen: str = env_field(env.ASYNC_HANDOFF_METRICS_LISTEN)

    @classmethod
    def from_env(cls) -> HandoffConfig:
        return cls(**{f.name: f.metadata["kind"](f.metadata["env"].get())
                      for f in fields(cls) if "env" in f.metadata})


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        c = lambda name, doc: Counter(f"async_handoff_{name}", doc, registry=r)  # noqa: E731
        self.rounds_ok = c("rounds_ok", "rounds answered in time")
        self.rounds_failed = c("rounds_failed", "rounds the adapter failed or the proxy lost")
        self.rounds_timed_out = c("rounds_timed_out", "rounds past their deadline")
        self.rounds_bad = c("rounds_bad", "rounds whose slot failed validation (garbage)")
        self.stale_dropped = c("stale_replies_dropped", "polls that found the round gone")
        self.no_slot = c("no_slot", "submits refused: every slot busy")
        self.disabled_skips = c("disabled_skips", "submits refused: handoff not running")
        self.watchdog_fires = c("watchdog_fires", "dead or stuck proxies detected")
        self.respawns = c("respawns", "proxies respawned")
        self.orphans_removed = c("orphan_regions_removed",
                                 "host-flags regions of dead engines removed at start")
        self.latency = Histogram("async_handoff_round_seconds", "submit -> reply taken",
                                 registry=r, buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2,
                                                      3e-2, 0.1, 0.3, 1.0))
        self.mlocked = Gauge("async_handoff_mlocked", "1 when the host flags are mlocked",
                             registry=r)
        self.enabled = Gauge("async_handoff_enabled", "1 while rounds go through the proxy",
                             registry=r)

    def value(self, counter) -> float:
        return counter._value.get()


def _key(t: Ticket) -> tuple:
    return id(t.flags), t.slot, t.seq


class Handoff:
    def __init__(self, config: HandoffConfig, adapter: str, adapter_config: dict | None = None):
        self.config = config
        if config.mode not in WAIT_MODES:
            raise ValueError(f"mode must be spin or nap, got {config.mode!r}")
        self.adapter, self.adapter_config = adapter, adapter_config or {}
        self.metrics = Metrics()
        self.flags: HostFlags | None = None
        self.proc: subprocess.Popen | None = None
        self.generation = 0
        self.enabled = False
        self.reason = "not started"
        self.proxy_status: dict = {}
        self._respawns: deque[float] = deque()
        self._retired: list[HostFlags] = []
        # Rounds handed out and not yet resolved: a caller may drop a ticket (no reply by
        # its next step), so submit() reclaims those past the round deadline.
        self._outstanding: dict[tuple, Ticket] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._http = None  # the counters' HTTP server (config.metrics_listen)
        self._mode = WAIT_MODES[config.mode]
        self._spin_ns = int(config.spin_us * 1000)

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> Handoff:
        """Create the host flags, start the proxy, wait for its self-test (startup bound)."""
        if self.config.metrics_listen:  # first: a handoff that cannot start says so there too
            from .exposition import serve
            try:
                self._http = serve(self.prometheus, self.config.metrics_listen)
            except OSError as exc:  # the counters stay unreadable; rounds are unaffected
                log.error("async handoff counters not served on %s: %s", self.config.metrics_listen, exc)
        removed, size = shm_files.remove_orphans(REGION_PREFIX)
        if removed:
            self.metrics.orphans_removed.inc(removed)
            log.warning("removed %d host-flags regions of engines that died without closing "
                        "them (%.1f MiB of %s)", removed, size / 2**20, shm_files.SHM_DIR)
        try:
            self.flags = self._new_flags()
        except (OSError, HostFlagsError) as exc:  # the engine serves on without remote drafts
            self._disable(self._no_region(exc))
            return self
        mlock = self.flags.lock()
        self.metrics.mlocked.set(mlock == "ok")
        log.info("host flags %s: mlock %s", self.flags.path, mlock)
        self._spawn()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="handoff-watchdog")
        self._watchdog.start()
        return self

    def _new_flags(self) -> HostFlags:
        return HostFlags.create(f"{REGION_PREFIX}{os.getpid()}-{secrets.token_hex(4)}",
                                self.config.slots, self.config.slot_bytes)

    def _no_region(self, exc: Exception) -> str:
        return (f"{NO_REGION}: {exc} (ASYNC_HANDOFF_SLOTS x ASYNC_HANDOFF_SLOT_BYTES = "
                f"{self.config.slots} x {self.config.slot_bytes} bytes; a container's /dev/shm is "
                "its --shm-size)")

    def _spawn(self) -> bool:
        """Start a proxy for a fresh generation; True once its self-test passed."""
        if not os.path.exists(self.flags.path):  # the region was removed underneath: renew it
            old = self.flags
            old.new_generation()
            try:
                self.flags = self._new_flags()
            except (OSError, HostFlagsError) as exc:  # stays disabled (the watchdog leaves it)
                self._disable(self._no_region(exc))
                return False
            self.metrics.mlocked.set(self.flags.lock() == "ok")
            self._retired.append(old)  # outstanding tickets still point into it: keep mapped
        self.generation, reclaimed = self.flags.new_generation()
        if reclaimed:
            self.metrics.rounds_failed.inc(reclaimed)
        c = self.config
        cmd = [sys.executable, "-m", "async_handoff.proxy", "--region", self.flags.path,
               "--generation", str(self.generation), "--adapter", self.adapter,
               "--adapter-config", json.dumps(self.adapter_config), "--mode", c.mode,
               "--spin-us", str(c.spin_us), "--round-deadline-ms", str(c.round_deadline_ms),
               "--heartbeat-ms", str(min(100.0, c.heartbeat_timeout_ms / 4))]
        cmd += ["--cpus", c.proxy_cpus] if c.proxy_cpus else []
        self.proc = subprocess.Popen(cmd, env={**os.environ, **c.proxy_env},
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + c.startup_timeout_s
        while time.monotonic() < deadline:
            info = self.flags.info()
            if info.proxy_pid == self.proc.pid and info.proxy_state in (PROXY_READY, PROXY_FAILED):
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        self.proxy_status = self.flags.read_status()
        info = self.flags.info()
        if info.proxy_pid == self.proc.pid and info.proxy_state == PROXY_READY:
            self.enabled, self.reason = True, "running"
            self.metrics.enabled.set(1)
            log.info("proxy %d ready (generation %d): %s", self.proc.pid, self.generation,
                     self.proxy_status)
            return True
        self._kill()
        self._disable(f"proxy self-test failed: {self.proxy_status.get('error', 'no answer')}")
        return False

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)  # also ends a SIGSTOPped proxy
            self.proc.wait()

    def _disable(self, reason: str) -> None:
        self.enabled, self.reason = False, reason
        self.metrics.enabled.set(0)
        log.error("async handoff disabled: %s (decoding continues without remote drafts)", reason)

    def _watch(self) -> None:
        # the proxy beats between rounds, and a round may run for up to its deadline: only a
        # proxy silent for longer than both is stuck (a slow round on a loaded machine is not)
        timeout_ns = (self.config.heartbeat_timeout_ms + self.config.round_deadline_ms) * 1e6
        while not self._stop.wait(self.config.watchdog_interval_s):
            with self._lock:
                if self.enabled:
                    dead = self.proc.poll() is not None
                    if not dead and self.flags.info().heartbeat_age_ns <= timeout_ns:
                        continue
                    self.metrics.watchdog_fires.inc()
                    log.warning("proxy %d %s; restarting it", self.proc.pid,
                                "died" if dead else "is stuck (heartbeat stale)")
                    self.enabled = False
                    self.metrics.enabled.set(0)
                    self._kill()
                elif self.reason.startswith((RESPAWN_BOUND, NO_REGION)):
                    continue  # stays disabled, saying why: no flapping
                if not self._respawn_allowed():
                    self._disable(f"{RESPAWN_BOUND} reached ({self.config.respawn_max} in "
                                  f"{self.config.respawn_window_s:.0f} s)")
                    continue
                self.metrics.respawns.inc()
                self._spawn()

    def _respawn_allowed(self) -> bool:
        now = time.monotonic()
        while self._respawns and now - self._respawns[0] > self.config.respawn_window_s:
            self._respawns.popleft()
        if len(self._respawns) >= self.config.respawn_max:
            return False
        self._respawns.append(now)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        with self._lock:
            self._kill()
            self.enabled = False
            if self.flags is not None:
                self.flags.close(unlink=True)
            for old in self._retired:
                old.close()

    def __enter__(self) -> Handoff:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- rounds (never block past max_wait) ---------------------------------------------------
    def submit(self, request: bytes) -> Ticket | None:
        """Hand a round to the proxy; None when it cannot take one (no drafts this step)."""
        self._sweep()
        if not self.enabled:
            self.metrics.disabled_skips.inc()
            return None
        flags = self.flags
        result = flags.submit(request)
        if result == lib.HF_ETOOBIG:
            raise ValueError(f"round of {len(request)} bytes exceeds the slot size "
                             f"{flags.slot_bytes}")
        if isinstance(result, Ticket):
            self._outstanding[_key(result)] = result
            return result
        (self.metrics.no_slot if result == lib.HF_EFULL else self.metrics.stale_dropped).inc()
        return None

    def _sweep(self) -> None:
        """Abandon every outstanding round past its deadline (the caller may have dropped
        its ticket): the slot is freed, the round counted as timed out."""
        limit = time.monotonic() - self.config.round_deadline_ms / 1000
        for t in list(self._outstanding.values()):
            if t.submitted < limit:
                self.abandon(t)

    def abandon(self, ticket: Ticket | None) -> None:
        """Give up on a round: its slot is freed now, and a late reply is dropped."""
        if ticket is None or self._outstanding.pop(_key(ticket), None) is None:
            return
        if ticket.flags.reclaim(ticket):
            self.metrics.rounds_timed_out.inc()

    def poll(self, ticket: Ticket | None) -> bytes | None:
        """The reply if it is there and belongs to this round; None otherwise (and a round
        past its deadline is abandoned)."""
        if ticket is None:
            return None
        rc, reply, status = ticket.flags.poll(ticket)
        if rc == lib.HF_PENDING:
            if (time.monotonic() - ticket.submitted) * 1000 > self.config.round_deadline_ms:
                self.abandon(ticket)
            return None
        self._outstanding.pop(_key(ticket), None)
        if rc == lib.HF_OK:
            if status == lib.HF_ROUND_OK:
                self.metrics.rounds_ok.inc()
                self.metrics.latency.observe(time.monotonic() - ticket.submitted)
                return reply
            {lib.HF_ROUND_TIMEOUT: self.metrics.rounds_timed_out,
             lib.HF_ROUND_BAD: self.metrics.rounds_bad}.get(status, self.metrics.rounds_failed).inc()
            return None
        (self.metrics.rounds_bad if rc == lib.HF_EBAD else self.metrics.stale_dropped).inc()
        return None

    def wait(self, ticket: Ticket | None, timeout_s: float | None = None) -> bytes | None:
        """poll(), after waiting for the reply at most min(timeout_s, max_wait)."""
        if ticket is None:
            return None
        bound = self.config.max_wait_ms / 1000
        wait_s = bound if timeout_s is None else min(timeout_s, bound)
        ticket.flags.wait_reply(ticket, self._mode, self._spin_ns, time.monotonic() + wait_s)
        return self.poll(ticket)

    def prometheus(self) -> str:
        return generate_latest(self.metrics.registry).decode()

    def counters(self) -> dict:
        m = self.metrics
        return {name: m.value(getattr(m, name)) for name in (
            "rounds_ok", "rounds_failed", "rounds_timed_out", "rounds_bad", "stale_dropped",
            "no_slot", "disabled_skips", "watchdog_fires", "respawns", "orphans_removed")}
