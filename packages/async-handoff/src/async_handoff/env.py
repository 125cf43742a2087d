"""Every environment variable async_handoff reads, with its default and what it does.

Read when a Handoff is created; changing one in a running engine does nothing until it
restarts. Rollback: unset VLLM_DSPARK_REMOTE_ASYNC on both ranks -> synchronous rounds.
"""

from __future__ import annotations

from collections.abc import Mapping

from ofl.env import EnvVar

VLLM_DSPARK_REMOTE_ASYNC = EnvVar(
    "VLLM_DSPARK_REMOTE_ASYNC", "",
    "1 = remote draft rounds go through the proxy process; empty or 0 = synchronous rounds "
    "in the engine (the reference deployment's switch; another value is refused).",
    kind="flag")
ASYNC_HANDOFF_WAIT_MODE = EnvVar(
    "ASYNC_HANDOFF_WAIT_MODE", "nap",
    "How the proxy and a waiting engine wait for a flag: spin (busy-poll with pause/yield; "
    "lowest latency, burns a core) or nap (spin briefly, then futex sleep).",
    choices=("spin", "nap"))
ASYNC_HANDOFF_SPIN_US = EnvVar(
    "ASYNC_HANDOFF_SPIN_US", "50", "nap mode: microseconds to spin before sleeping.",
    kind="number")
ASYNC_HANDOFF_SLOTS = EnvVar("ASYNC_HANDOFF_SLOTS", "4", "Rounds in flight at most.",
    kind="int")
ASYNC_HANDOFF_SLOT_BYTES = EnvVar(
    "ASYNC_HANDOFF_SLOT_BYTES", str(1 << 20), "Largest request and largest reply (bytes).",
    kind="int")
ASYNC_HANDOFF_ROUND_DEADLINE_MS = EnvVar(
    "ASYNC_HANDOFF_ROUND_DEADLINE_MS", "100",
    "A round older than this is abandoned (reclaimed, counted timed out); the proxy also "
    "gives the adapter this deadline.",
    kind="number")
ASYNC_HANDOFF_MAX_WAIT_MS = EnvVar(
    "ASYNC_HANDOFF_MAX_WAIT_MS", "20", "The longest any engine-side call may block.",
    kind="number")
ASYNC_HANDOFF_HEARTBEAT_TIMEOUT_MS = EnvVar(
    "ASYNC_HANDOFF_HEARTBEAT_TIMEOUT_MS", "1000",
    "A proxy silent for longer than this plus ASYNC_HANDOFF_ROUND_DEADLINE_MS (it beats "
    "between rounds) is stuck: the watchdog kills and respawns it.",
    kind="number")
ASYNC_HANDOFF_RESPAWN_MAX = EnvVar(
    "ASYNC_HANDOFF_RESPAWN_MAX", "3", "Respawns allowed per window; past it the handoff "
    "stays disabled (target-only decoding) instead of flapping.",
    kind="int")
ASYNC_HANDOFF_RESPAWN_WINDOW_S = EnvVar(
    "ASYNC_HANDOFF_RESPAWN_WINDOW_S", "300", "The respawn window (seconds).",
    kind="number")
ASYNC_HANDOFF_STARTUP_TIMEOUT_S = EnvVar(
    "ASYNC_HANDOFF_STARTUP_TIMEOUT_S", "30", "How long a new proxy may take to pass its self-test.",
    kind="number")
ASYNC_HANDOFF_PROXY_CPUS = EnvVar(
    "ASYNC_HANDOFF_PROXY_CPUS", "",
    "CPUs the proxy runs on, as a list like 3 or 2,5-6 (it pins itself at start); keep it off "
    "the cores the engine's threads busy, so a round moves while the engine works. Empty = "
    "the engine's own CPUs.")
ASYNC_HANDOFF_METRICS_LISTEN = EnvVar(
    "ASYNC_HANDOFF_METRICS_LISTEN", "",
    "HOST:PORT where the engine process serves its Handoff's counters (GET /metrics: rounds "
    "ok/failed/timed out, watchdog fires, respawns, enabled) for status checks "
    "(async-handoff counters); one Handoff per address; empty = not served.",
    kind="address")

ALL = [VLLM_DSPARK_REMOTE_ASYNC, ASYNC_HANDOFF_WAIT_MODE, ASYNC_HANDOFF_SPIN_US,
       ASYNC_HANDOFF_SLOTS, ASYNC_HANDOFF_SLOT_BYTES, ASYNC_HANDOFF_ROUND_DEADLINE_MS,
       ASYNC_HANDOFF_MAX_WAIT_MS, ASYNC_HANDOFF_HEARTBEAT_TIMEOUT_MS, ASYNC_HANDOFF_RESPAWN_MAX,
       ASYNC_HANDOFF_RESPAWN_WINDOW_S, ASYNC_HANDOFF_STARTUP_TIMEOUT_S, ASYNC_HANDOFF_PROXY_CPUS,
       ASYNC_HANDOFF_METRICS_LISTEN]


def async_enabled(values: Mapping[str, str] | None = None) -> bool:
    """Remote rounds go through the proxy: VLLM_DSPARK_REMOTE_ASYNC set in this process's
    environment, or in `values` (e.g. a launcher's env file, read before the engine starts)."""
    value = VLLM_DSPARK_REMOTE_ASYNC.get() if values is None else \
        values.get(VLLM_DSPARK_REMOTE_ASYNC.name, VLLM_DSPARK_REMOTE_ASYNC.default)
    if why := VLLM_DSPARK_REMOTE_ASYNC.problem(value):  # "true" or "no": which was meant is unclear
        raise ValueError(why)
    return value == "1"
