"""EngramClient: this rank's Engram rows, from an offload host when it can, from the
local shard when it cannot - the same bytes either way.

Per step: row ids (known from token ids alone, before the forward reaches layer 1 or 14)
are deduplicated and fetched with one batched gather per layer. Every remote gather has a
deadline; a host that fails is set aside and the read goes to the next healthy host within
the same deadline (replicas.py: failover, readmission, quarantine); only when no host
answers do the rows come from the local shard, counted. Each server's manifest is checked on
every (re)connect: a server holding other tables is refused.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ofl import Connection, Region
from ofl.http import read_counters, read_health
from ofl.stats import Stats
from ofl.wire import decode_json

from . import env
from .geometry import ROW_BYTES, EngramGeometry
from .hashing import row_ids
from .replicas import Hosts
from .shard import ShardReader, shard_name


class EngramUnavailable(RuntimeError):
    """Neither the remote table nor a local shard can serve these rows."""


class EngramClient:
    """Rows of `rank`'s shards for each layer of `geometry`.

    >>> c = EngramClient(geometry=V41, rank=0, shard_dir="/nvme/engram",
    ...                  remote=["10.0.0.1:7480", "10.0.0.2:7480"], backend="verbs")
    >>> h = c.prefetch(token_ids)          # at forward entry
    >>> rows = c.wait(h)                   # {layer: [B, T, 12, 264] uint8} at layer 1 / 14
    """

    def __init__(self, *, geometry: EngramGeometry, rank: int, nranks: int = 2,
                 shard_dir: str | None = None, remote: str | list[str] | None = None,
                 backend: str | None = None, token_map: np.ndarray | None = None,
                 deadline_s: float | None = None, backoff_s: float | None = None,
                 prefetch_depth: int | None = None):
        """`remote`: this rank's offload hosts (HOST:PORT, or a list of hosts serving the same
        rows); default ENGRAM_HOSTS / ENGRAM_REMOTE."""
        self.geometry, self.rank, self.nranks = geometry, rank, nranks
        self.columns = geometry.rank_columns(rank, nranks)
        self.ranges = {layer: geometry.rank_rows(layer, rank, nranks) for layer in geometry.layers}
        self.token_map = token_map
        self.deadline_s = deadline_s or env.ENGRAM_DEADLINE_MS.get_float() / 1000
        self.backoff_s = backoff_s if backoff_s is not None else env.ENGRAM_BACKOFF_S.get_float()
        self.stats = Stats("engram_client", {"rank": str(rank)})
        self.local: dict[int, ShardReader] = {}
        shard_dir = shard_dir if shard_dir is not None else env.ENGRAM_SHARD_DIR.get()
        if shard_dir:
            for layer in geometry.layers:
                self.local[layer] = self._open_local(shard_dir, layer)
        if remote is None:
            remote = env.hosts_for_rank(rank)
        addresses = [remote] if isinstance(remote, str) else list(remote)
        addresses = [a for a in addresses if a]
        if not addresses and not self.local:
            raise ValueError("EngramClient needs a remote endpoint, local shards, or both")
        self.hosts = Hosts(addresses, backend=backend or env.ENGRAM_BACKEND.get(), rank=rank,
                           ranges=self.ranges, total_rows={k: geometry.rows(k) for k in geometry.layers},
                           local=self.local, deadline_s=self.deadline_s, recheck_s=self.backoff_s,
                           stats=self.stats) if addresses else None
        self._scratch: Region | None = None
        self._lock = threading.Lock()
        depth = prefetch_depth or env.ENGRAM_PREFETCH_DEPTH.get_int()
        self._slots = threading.BoundedSemaphore(depth)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-prefetch")

    def _open_local(self, shard_dir: str, layer: int) -> ShardReader:
        path = os.path.join(shard_dir, shard_name(layer, self.rank, self.nranks))
        reader = ShardReader(path)
        lo, hi = self.ranges[layer]
        if (reader.layer, reader.lo, reader.hi, reader.header.total_rows) != \
                (layer, lo, hi, self.geometry.rows(layer)):
            raise ValueError(f"{path}: holds layer {reader.layer} rows [{reader.lo}, {reader.hi}) "
                             f"of {reader.header.total_rows}; the geometry wants layer {layer} "
                             f"[{lo}, {hi}) of {self.geometry.rows(layer)}")
        return reader

    # -- fetching ------------------------------------------------------------------------
    def fetch(self, layer: int, ids) -> np.ndarray:
        """Rows for global row ids `ids` (any shape) as uint8 [*ids.shape, 264]."""
        ids = np.asarray(ids, dtype=np.int64)
        lo, hi = self.ranges[layer]
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < lo or flat.max() >= hi):
            raise ValueError(f"layer {layer} rank {self.rank}: row ids must lie in [{lo}, {hi})")
        uniq, inverse = np.unique(flat, return_inverse=True)
        if not uniq.size:
            return np.empty(ids.shape + (ROW_BYTES,), np.uint8)
        with self._lock:
            rows = self._remote_rows(layer, uniq)
            if rows is None:
                rows = self._local_rows(layer, uniq)
            out = rows[inverse]
        self.stats.add("fetches")
        self.stats.add("rows", flat.size)
        self.stats.add("unique_rows", uniq.size)
        return out.reshape(ids.shape + (ROW_BYTES,))

    def _remote_rows(self, layer: int, uniq: np.ndarray) -> np.ndarray | None:
        if self.hosts is None:
            return None
        scratch = self._scratch_for(uniq.size * ROW_BYTES)
        if not self.hosts.gather(layer, uniq, scratch):
            if not self.local:
                raise EngramUnavailable(f"layer {layer}: no offload host answered and there is "
                                        f"no local shard ({self.hosts.status()})")
            return None
        self.stats.add("remote_rows", uniq.size)
        return scratch.array[:uniq.size * ROW_BYTES].reshape(uniq.size, ROW_BYTES)

    def _local_rows(self, layer: int, uniq: np.ndarray) -> np.ndarray:
        reader = self.local.get(layer)
        if reader is None:
            raise EngramUnavailable(f"layer {layer}: no offload host serves it now and there is "
                                    "no local shard")
        self.stats.add("local_rows", uniq.size)
        return reader.rows(uniq)

    def _scratch_for(self, nbytes: int) -> Region:
        if self._scratch is None or self._scratch.length < nbytes:
            size = 1 << max(20, (nbytes - 1).bit_length())  # grow in powers of two
            self._scratch = Region.allocate("engram-rows", size)
        return self._scratch

    def fetch_tokens(self, tokens, valid=None) -> dict[int, np.ndarray]:
        """{layer: [B, T, C, 264]} for raw token ids [B, T]; C = this rank's columns."""
        if self.token_map is None:
            raise ValueError("fetch_tokens needs the compressed token_map")
        return {layer: self.fetch(layer, row_ids(self.geometry, layer, tokens, self.token_map,
                                                 valid, columns=self.columns))
                for layer in self.geometry.layers}

    def prefetch(self, tokens, valid=None) -> Future:
        """Start fetch_tokens in the background (at forward entry); wait() collects it."""
        return self._submit(self.fetch_tokens, tokens, valid)

    def fetch_async(self, layer: int, ids) -> Future:
        """Start fetch(layer, ids) in the background (the vLLM overlay's prefetch)."""
        return self._submit(self.fetch, layer, ids)

    def _submit(self, fn, *args) -> Future:
        # At most ENGRAM_PREFETCH_DEPTH fetches are in flight; a further call waits.
        self._slots.acquire()
        future = self._pool.submit(fn, *args)
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def wait(self, handle: Future, timeout: float | None = None) -> dict[int, np.ndarray]:
        return handle.result(timeout)

    def host_status(self) -> list[dict]:
        """Each offload host: address, state (healthy, failed, quarantined) and why, since
        when, rows it served, layers it serves."""
        return self.hosts.status() if self.hosts is not None else []

    def prometheus(self) -> str:
        """The counters, and a gauge per offload host (healthy or not, with its state)."""
        return self.stats.prometheus() + (self.hosts.prometheus() if self.hosts is not None else "")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.hosts is not None:
            self.hosts.close()
        for reader in self.local.values():
            reader.close()


def server_health(address: str, backend: str = "tcp", timeout_s: float = 10,
                  identity: str = "remote-engram-health") -> dict:
    """An Engram server's health (tables resident, mlock, hugepages, load times, links and
    how each admits peers), asked over its own link with the control op the server answers."""
    with Connection(address, backend=backend, identity=identity) as conn:
        return decode_json(conn.request(b'{"op":"health"}', deadline_s=timeout_s), "health reply")


def served_counters(listen: str, timeout_s: float = 10) -> dict[str, float]:
    """An engine rank's EngramClient counters, read from its /metrics (ENGRAM_METRICS_LISTEN,
    HOST:PORT): {name: value} without the engram_client_ prefix and _total suffix."""
    return read_counters(listen, "engram_client_", timeout_s)


def served_hosts(listen: str, timeout_s: float = 10) -> list[dict]:
    """An engine rank's offload hosts as its EngramClient sees them (state, reason, since,
    rows, layers), read from its /health (ENGRAM_METRICS_LISTEN, HOST:PORT)."""
    return read_health(listen, timeout_s).get("hosts", [])
