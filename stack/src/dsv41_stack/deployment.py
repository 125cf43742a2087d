"""This machine's roles as long-lived processes (`up`, `down`, `status`, `logs`, `canary`):
detached, with pid files and logs under STACK_RUN_DIR, brought up in the reference order —
offload host first (Engram server, drafter worker), then the engine — each waited for until
it serves; the engine's canary last. An engine across hosts: rank R > 0 first (it waits for
rank 0 in vLLM's rendezvous), then rank 0, whose API answers once all ranks joined; status
and canary are answered by rank 0 (its API, its Engram and async handoff counters)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from async_handoff import env as handoff_env
from async_handoff.env import async_enabled
from ofl.http import read_health
from remote_drafter import env as drafter_env
from remote_engram import env as engram_env

from .config import StackConfig
from .processes import STOP_TIMEOUT_S, Running, role_env
from .roles import SERVED_NAME, Role, engine, rank_address, roles, speculative_config

# The async proxy's counters that must not move during the canary (rounds timed out are not
# among them: a round abandoned when its request ends counts as timed out).
HANDOFF_FAILURES = ("rounds_failed", "rounds_bad", "watchdog_fires", "respawns")


class Deployment:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.run = Path(cfg["STACK_RUN_DIR"])
        self.pids, self.logs = self.run / "pids", self.run / "logs"

    # -- processes -------------------------------------------------------------------------
    def pid(self, role: Role) -> int | None:
        """The role's live pid, or None (a pid file of a dead process is removed)."""
        path = self.pids / f"{role.name}.pid"
        if not path.exists():
            return None
        pid = int(path.read_text())
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child has ended (up and down
                path.unlink()                           # in one process): reaped, not a zombie
                return None
        except ChildProcessError:
            pass  # started by another process
        try:
            os.kill(pid, 0)
            return pid
        except ProcessLookupError:
            path.unlink()
            return None

    def up(self, role_filter: str | None = None, say=print, timeout_s: float = 900,
           rank: int | None = None) -> None:
        self.pids.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        for role in roles(self.cfg, role_filter, rank):
            missing = self.missing_input(role)
            if missing:
                raise FileNotFoundError(f"{role.name}: {missing}")
        started = []
        try:
            for role in roles(self.cfg, role_filter, rank):
                if role.rank is not None:
                    self.check_offload_host(say, role.rank)
                if self.pid(role):
                    say(f"{role.name}: already running (pid {self.pid(role)})")
                    continue
                log = self.logs / f"{role.name}.log"
                with open(log, "w") as out:
                    proc = subprocess.Popen(role.command, stdout=out, stderr=subprocess.STDOUT,
                                            env=role_env(role), start_new_session=True)
                (self.pids / f"{role.name}.pid").write_text(str(proc.pid))
                started.append(role)
                took = Running(role, proc, log).wait_ready(timeout_s)
                if role.rank:
                    say(f"{role.name}: started in {took:.1f} s (pid {proc.pid}, log {log}); it "
                        f"waits for rank 0 at {self.cfg['STACK_ENGINE_MASTER']} (vLLM's rendezvous): "
                        "start rank 0 now (up --role engine --rank 0); the canary runs there")
                else:
                    say(f"{role.name}: ready in {took:.1f} s (pid {proc.pid}, log {log})")
        except BaseException:
            for role in reversed(started):  # nothing half up
                self.stop(role)
            raise

    def check_offload_host(self, say, rank: int = 0) -> None:
        """Reference order: the engine starts only once the rows it will read are qualified
        and the worker's identities match."""
        from .preflight import offload_links, report
        checks = offload_links(self.cfg, rank)
        if checks:
            say(report(checks))
        if not all(c.ok for c in checks):
            raise RuntimeError("the offload host is not ready for this engine (see above); "
                               "start it first or fix the links")

    def missing_input(self, role: Role) -> str | None:
        """What a role needs on disk before it can start, if it is not there."""
        if role.rank is not None and not (Path(self.cfg["STACK_MODEL"]) / "config.json").exists():
            return f"no checkpoint at STACK_MODEL={self.cfg['STACK_MODEL']!r}"
        if role.name == "engram-server" and not any(Path(self.cfg["STACK_ENGRAM_SHARDS"]).glob("*.bin")):
            return f"no shards in STACK_ENGRAM_SHARDS={self.cfg['STACK_ENGRAM_SHARDS']!r}"
        return None

    def stop(self, role: Role, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        pid = self.pid(role)
        if pid is None:
            return False
        os.killpg(pid, signal.SIGTERM)  # its own session: vLLM's workers go with it
        deadline = time.monotonic() + timeout_s
        while (self.pid(role) or group_alive(pid)) and time.monotonic() < deadline:
            time.sleep(0.2)  # until its children (vLLM's workers, a TP2 pair's ranks) are gone too
        if self.pid(role) or group_alive(pid):
            os.killpg(pid, signal.SIGKILL)
            time.sleep(0.5)
        (self.pids / f"{role.name}.pid").unlink(missing_ok=True)
        return True

    def down(self, role_filter: str | None = None, say=print, rank: int | None = None) -> None:
        for role in reversed(roles(self.cfg, role_filter, rank)):  # the engine first
            say(f"{role.name}: {'stopped' if self.stop(role) else 'not running'}")

    # -- looking at it ---------------------------------------------------------------------
    def engine_url(self) -> str:
        return f"http://{self.cfg['STACK_ENGINE_LISTEN']}"

    def status(self, role_filter: str | None = None, rank: int | None = None) -> dict:
        """Each role's process and what it says of itself: the engine its spec-decode and
        Engram counters and the async proxy's (when the handoff is on), a headless rank its
        own Engram and proxy counters, the Engram server its health (tables resident, mlock,
        links), the drafter worker its counters."""
        out = {}
        for role in roles(self.cfg, role_filter, rank):
            pid = self.pid(role)
            entry = {"pid": pid, "running": pid is not None}
            if pid:
                try:
                    with self.cfg.link_client():  # the servers may ask for the key
                        entry.update(self.health(role))
                except Exception as exc:  # noqa: BLE001 - status reports, it does not fail
                    entry["error"] = f"{type(exc).__name__}: {exc}"
            out[role.name] = entry
        return out

    def health(self, role: Role) -> dict:
        if role.rank is not None:
            out = {"counters": self.counters()} if role.rank == 0 else {}
            if listen := self.cfg[engram_env.ENGRAM_METRICS_LISTEN]:
                from remote_engram.client import served_counters, served_hosts
                if role.rank:
                    out["engram"] = served_counters(rank_address(listen, role.rank), timeout_s=5)
                out["engram_hosts"] = served_hosts(rank_address(listen, role.rank), timeout_s=5)
            if role.rank == 0 and (listen := self.cfg[drafter_env.REMOTE_DRAFTER_METRICS_LISTEN]):
                try:  # the worker pool as rank 0's proposer sees it (the rank that drafts)
                    out["drafter_workers"] = read_health(listen, timeout_s=5).get("workers", [])
                except OSError as exc:
                    out["drafter_workers"] = f"unreadable: {exc}"
            if self.async_on():
                out["handoff"] = self.handoff_counters(role.rank)
            return out
        listen = role.command[role.command.index("--listen") + 1]
        if role.name == "engram-server":
            from remote_engram.client import server_health
            return {"health": server_health(listen, self.cfg[engram_env.ENGRAM_BACKEND],
                                            timeout_s=5, identity="dsv41-stack-status")}
        from remote_drafter.engine.transport import worker_stats
        return {"counters": worker_stats(listen, self.cfg[drafter_env.REMOTE_DRAFTER_BACKEND])}

    def canary(self, record: bool = False) -> dict:
        """Greedy fingerprint of fixed prompts vs the recorded reference (rank 0's API), and
        fresh counters over those requests: drafts made when a drafter is configured, no
        Engram fallback, and with the async handoff on, the proxy's (rank 0's): rounds
        answered, none failed or bad, no watchdog fire or respawn, still enabled."""
        import httpx

        from longctx_bench.runner import RunConfig, fingerprint, fingerprint_errors

        async def measure():
            async with httpx.AsyncClient() as client:
                return await fingerprint(client, RunConfig(self.engine_url(), SERVED_NAME, [], []))

        before, engram_before, handoff_before = self.spec_counters(), self.engram_counters(), self.handoff_counters()
        got = asyncio.run(measure())
        after, engram_after, handoff_after = self.spec_counters(), self.engram_counters(), self.handoff_counters()
        moved = {k: after[k] - before.get(k, 0.0) for k in after}
        handoff = handoff_moved(handoff_before, handoff_after) if self.async_on() else None
        degraded = ["no drafts made"] if speculative_config(self.cfg) and \
            not drafts_made(moved, handoff, self.async_on()) else []
        engram_listen = self.cfg[engram_env.ENGRAM_METRICS_LISTEN]
        degraded += engram_degraded(engram_listen, engram_before, engram_after)
        if self.async_on():
            degraded += handoff_degraded(handoff, handoff_after, self.handoff_listen())
        checked = (["drafts made"] if speculative_config(self.cfg) else []) + \
            (["no Engram fallback"] if engram_listen else [])
        common = {"fingerprint": got["all"], "degraded": degraded, "handoff": handoff,
                  "checked": checked}
        if errors := fingerprint_errors(got):  # never recorded, never equal to a reference
            return {"ok": False, "recorded": False, "errors": errors, **common}
        path = self.run / "canary-reference.json"
        if record or not path.exists():
            path.write_text(json.dumps(got, indent=2))
            return {"ok": not degraded, "recorded": True, **common}
        want = json.loads(path.read_text())
        return {"ok": got["all"] == want["all"] and not degraded, "recorded": False,
                "reference": want["all"], "differs": [k for k in want if got.get(k) != want[k]],
                **common}

    def async_on(self) -> bool:
        """Draft rounds go through the async proxy: a remote drafter, speculation, and the
        async handoff enabled by the env files (as the engine's async_handoff reads it)."""
        return bool(speculative_config(self.cfg) and self.cfg[drafter_env.REMOTE_DRAFTER_ADDRESS]
                    and async_enabled(self.cfg.values))

    def handoff_listen(self, rank: int = 0) -> str:
        """Where engine rank `rank` serves its async proxy counters ('' = nowhere)."""
        metrics = handoff_env.ASYNC_HANDOFF_METRICS_LISTEN
        return engine(self.cfg, rank).env.get(metrics.name, metrics.default)

    def handoff_counters(self, rank: int = 0) -> dict | None:
        """The async proxy's counters of engine rank `rank` (async_handoff.exposition), or
        None when they cannot be read (not configured, or nothing answers)."""
        from async_handoff.exposition import read
        listen = self.handoff_listen(rank)
        try:
            return read(listen) if listen else None
        except OSError:
            return None

    def counters(self) -> dict:
        """The engine's spec-decode counters and, where its overlay serves metrics
        (ENGRAM_METRICS_LISTEN) and they could be read, rank 0's Engram client counters."""
        return {**self.spec_counters(), **(self.engram_counters() or {})}

    def spec_counters(self) -> dict:
        """The engine's spec-decode counters (those that read as numbers)."""
        return {k: v for k, v in engine_counters(self.engine_url()).items() if isinstance(v, float)}

    def engram_counters(self) -> dict | None:
        """Rank 0's Engram client counters, or None when they cannot be read (not served, or
        nothing answers)."""
        from remote_engram.client import served_counters
        listen = self.cfg[engram_env.ENGRAM_METRICS_LISTEN]
        try:
            return served_counters(listen, timeout_s=5) if listen else None
        except OSError:
            return None


def group_alive(pgid: int) -> bool:
    """Is any process of this process group still there?"""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def handoff_moved(before: dict | None, after: dict | None) -> dict | None:
    """How far the async proxy's counters moved (None when either reading is missing)."""
    if before is None or after is None:
        return None
    return {k: after.get(k, 0.0) - before.get(k, 0.0)
            for k in ("rounds_ok", "rounds_timed_out", *HANDOFF_FAILURES)}


def drafts_made(moved: dict, handoff: dict | None, asynchronous: bool) -> bool:
    """Did drafts reach the engine over the canary? Through the async proxy only an answered
    round brings drafts: vLLM's drafts counter also counts the placeholders a failed or late
    round leaves for verification, so there it proves nothing."""
    if asynchronous:
        return bool(handoff and handoff["rounds_ok"] > 0)
    return bool(moved.get("num_drafts"))


def engram_degraded(listen: str, before: dict | None, after: dict | None) -> list[str]:
    """What rank 0's Engram client counters over the canary say is wrong: unreadable where
    they are served (`listen`), or any row that came from disk or remote read that failed."""
    if not listen:
        return []
    if before is None or after is None:
        return [f"Engram counters unreadable at {listen}"]
    moved = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("fallbacks", "remote_failures")}
    return [f"Engram {k} +{v:.0f}" for k, v in moved.items() if v]


def handoff_degraded(moved: dict | None, after: dict | None, listen: str) -> list[str]:
    """What the async proxy's counters over the canary say is wrong: unreadable, any failed
    or bad round, watchdog fire or respawn, or the handoff disabled (no round answered is
    drafts_made's "no drafts made")."""
    if not listen:
        return ["async proxy counters not served: set ASYNC_HANDOFF_METRICS_LISTEN"]
    if moved is None or after is None:
        return [f"async proxy counters unreadable at {listen}"]
    out = [f"async proxy {k.replace('_', ' ')} +{moved[k]:.0f}" for k in HANDOFF_FAILURES if moved[k]]
    if after.get("enabled") == 0:
        out.append("async proxy disabled")
    return out


def engine_counters(url: str) -> dict:
    """The engine's spec-decode counters (vLLM /metrics), summed over labels."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError as exc:
        return {"error": str(exc)}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_") and "_total" in line:
            name = line.split("{")[0].split(" ")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
