"""Every environment variable remote_engram reads, with its default and what it does.

Read when an EngramClient or the server starts; changing one in a running engine does
nothing until it restarts. Rollback of remote Engram: unset ENGRAM_REMOTE (the client then
reads the local shards only).
"""

from __future__ import annotations

from ofl.env import EnvVar

ENGRAM_REMOTE = EnvVar(
    "ENGRAM_REMOTE", "",
    "Engram server HOST:PORT this rank reads from, or one per tensor-parallel rank separated by "
    "commas (rank r takes entry r: its own link); empty = local shards only.")
ENGRAM_HOSTS = EnvVar(
    "ENGRAM_HOSTS", "",
    "Several offload hosts serving the same qualified shards (or a subset of the layers), "
    "separated by ';', each written as ENGRAM_REMOTE is (HOST:PORT, or one per rank separated "
    "by commas): reads spread over the healthy ones and fail over between them; the local "
    "shards serve only when none answers. Set this or ENGRAM_REMOTE, not both.")
ENGRAM_BACKEND = EnvVar(
    "ENGRAM_BACKEND", "verbs", "ofl backend of the remote link: verbs, tcp or shm.",
    choices=("verbs", "tcp", "shm"))
ENGRAM_SHARD_DIR = EnvVar(
    "ENGRAM_SHARD_DIR", "",
    "Folder with this rank's local shards (engram-l{L}-r{rank}of{N}.bin): the exact fallback "
    "and the digests the server must match.")
ENGRAM_DEADLINE_MS = EnvVar(
    "ENGRAM_DEADLINE_MS", "50", "Deadline of one remote gather; past it the rows come from disk.",
    kind="number")
ENGRAM_BACKOFF_S = EnvVar(
    "ENGRAM_BACKOFF_S", "5",
    "How often a host whose read failed is checked again (reconnect, a sample of its rows "
    "against the local shards); it serves again only once they are equal.",
    kind="number")
ENGRAM_PREFETCH_DEPTH = EnvVar(
    "ENGRAM_PREFETCH_DEPTH", "4", "Prefetches in flight at most; more wait for a slot.",
    kind="int")

ENGRAM_METRICS_LISTEN = EnvVar(
    "ENGRAM_METRICS_LISTEN", "",
    "vLLM overlay: HOST:PORT where each engine rank serves GET /metrics and /health of its "
    "Engram client (rank r on PORT + r); empty = none.",
    kind="address")

ENGRAM_PREFETCH = EnvVar(
    "ENGRAM_PREFETCH", "1",
    "vLLM overlay: 1 = start each layer's fetch at forward entry (where the row ids are "
    "computed); 0 = fetch when the layer needs its rows (to measure what prefetch buys).",
    kind="flag")

ALL = [ENGRAM_REMOTE, ENGRAM_HOSTS, ENGRAM_BACKEND, ENGRAM_SHARD_DIR, ENGRAM_DEADLINE_MS, ENGRAM_BACKOFF_S,
       ENGRAM_PREFETCH_DEPTH, ENGRAM_METRICS_LISTEN, ENGRAM_PREFETCH]


def remote_for_rank(rank: int, value: str | None = None) -> str:
    """Rank `rank`'s entry of ENGRAM_REMOTE (one entry serves every rank); `value`: the
    variable's value as an env file gives it (default: this process's environment)."""
    value = ENGRAM_REMOTE.get() if value is None else value
    entries = [e.strip() for e in value.split(",") if e.strip()]
    if len(entries) > 1 and rank >= len(entries):
        raise ValueError(f"ENGRAM_REMOTE lists {len(entries)} endpoints; rank {rank} has none")
    return entries[min(rank, len(entries) - 1)] if entries else ""


def hosts_for_rank(rank: int, remote: str | None = None, hosts: str | None = None) -> list[str]:
    """Rank `rank`'s address on each offload host: ENGRAM_HOSTS's hosts, else ENGRAM_REMOTE's
    one (values as an env file gives them; default: this process's environment)."""
    remote = ENGRAM_REMOTE.get() if remote is None else remote
    hosts = ENGRAM_HOSTS.get() if hosts is None else hosts
    if remote.strip() and hosts.strip():
        raise ValueError("both ENGRAM_REMOTE and ENGRAM_HOSTS are set: list every offload host "
                         "in ENGRAM_HOSTS and unset ENGRAM_REMOTE")
    listed = [h for h in hosts.split(";") if h.strip()] if hosts.strip() else [remote]
    return [a for a in (remote_for_rank(rank, h) for h in listed) if a]
