"""Every environment variable remote_engram reads, with its default and what it does.

Read when an EngramClient or the server starts; changing one in a running engine does
nothing until it restarts. Rollback of remote Engram: unset ENGRAM_REMOTE (the client then
reads the local shards only).
"""

from __future__ import annotations

from ofl.env import EnvVar

ENGRAM_REMOTE = EnvVar(
    "ENGRAM_REMOTE", "",
    "Engram server HOST:PORT this rank reads from (its own link); empty = local shards only.")
ENGRAM_BACKEND = EnvVar(
    "ENGRAM_BACKEND", "verbs", "ofl backend of the remote link: verbs, tcp or shm.")
ENGRAM_SHARD_DIR = EnvVar(
    "ENGRAM_SHARD_DIR", "",
    "Folder with this rank's local shards (engram-l{L}-r{rank}of{N}.bin): the exact fallback "
    "and the digests the server must match.")
ENGRAM_DEADLINE_MS = EnvVar(
    "ENGRAM_DEADLINE_MS", "50", "Deadline of one remote gather; past it the rows come from disk.")
ENGRAM_BACKOFF_S = EnvVar(
    "ENGRAM_BACKOFF_S", "5",
    "After a remote failure, read locally for this long before trying the link again.")
ENGRAM_PREFETCH_DEPTH = EnvVar(
    "ENGRAM_PREFETCH_DEPTH", "4", "Prefetches in flight at most; more wait for a slot.")

ALL = [ENGRAM_REMOTE, ENGRAM_BACKEND, ENGRAM_SHARD_DIR, ENGRAM_DEADLINE_MS, ENGRAM_BACKOFF_S,
       ENGRAM_PREFETCH_DEPTH]
