"""The offload hosts one rank reads its Engram rows from: a link to each, and what each is
fit for now.

Reads spread over the healthy hosts (round robin); a read that fails goes to the next host
within the same deadline, each host given its share of what is left (a failover), and only when no host answers do the rows come from
the local shard (a fallback). A host whose read failed is set aside and readmitted only once
it qualifies again: a sample of its rows equal to the local shard's, byte for byte. A host
whose manifest or rows differ from the local shards is quarantined for the life of the
process. A background thread re-checks the hosts set aside, so no step waits on it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from ofl import Connection, OflError, PeerRejected, Region
from ofl.stats import Stats

from .geometry import ROW_BYTES
from .qualify import mismatched_rows
from .shard import ShardReader

log = logging.getLogger("remote_engram.replicas")

HEALTHY, FAILED, QUARANTINED = "healthy", "failed", "quarantined"
RECHECK_SAMPLE = 256  # rows per layer compared before a host set aside is read again
RECHECK_DEADLINE_S = 10.0  # the re-check runs beside the steps: it may take its time


class ManifestMismatch(ValueError):
    """The server holds other tables than this rank expects."""


@dataclass
class Host:
    """One offload host's link for this rank and its state."""
    address: str
    index: int  # its place in the list: its link's name
    conn: Connection | None = None
    regions: dict[int, str] = field(default_factory=dict)  # layer -> region, set on connect
    state: str = HEALTHY
    reason: str = ""
    since: float = field(default_factory=time.time)
    rows: int = 0

    def status(self) -> dict:
        return {"address": self.address, "state": self.state, "reason": self.reason,
                "since": round(self.since, 3), "rows": self.rows, "layers": sorted(self.regions)}


class Hosts:
    """This rank's offload hosts. `ranges`: {layer: (lo, hi)} of the rank's rows;
    `total_rows`: {layer: rows of the whole table}; `local`: its shards ({layer: reader}:
    the digests a host must match and the rows it is checked against; may be empty);
    `recheck_s`: how often hosts set aside are tried again."""

    def __init__(self, addresses: list[str], *, backend: str, rank: int, ranges: dict,
                 total_rows: dict, local: dict[int, ShardReader], deadline_s: float,
                 recheck_s: float, stats: Stats):
        self.backend, self.rank, self.ranges, self.total_rows = backend, rank, ranges, total_rows
        self.local, self.deadline_s, self.recheck_s, self.stats = local, deadline_s, recheck_s, stats
        self.digests = {layer: r.digest() for layer, r in local.items()}
        self.hosts = [Host(a, i) for i, a in enumerate(addresses)]
        for host in self.hosts:
            host.conn = self._connection(host)
        self._next = 0
        self._lock = threading.Lock()  # host states; a healthy host's link is the reader's
        self._stop = threading.Event()
        self._checker = threading.Thread(target=self._recheck_loop, daemon=True,
                                         name=f"engram-hosts-r{rank}")
        self._checker.start()

    def _connection(self, host: Host) -> Connection:
        def verify(manifest: dict) -> None:
            host.regions = self._served(manifest)
        link = f"rank{self.rank}" if host.index == 0 else f"rank{self.rank}-host{host.index}"
        return Connection(host.address, backend=self.backend, identity=f"engram-client-r{self.rank}",
                          link=link, deadline_s=self.deadline_s, connect=False, verify_peer=verify)

    def _served(self, manifest: dict) -> dict[int, str]:
        """On every (re)connect: which of this rank's shards the host serves ({layer:
        region}), each with the local shard's digest; a host serving none, or another
        table, is refused."""
        regions = {}
        for layer, (lo, hi) in self.ranges.items():
            match = [s for s in manifest.get("shards", []) if s.get("layer") == layer
                     and s.get("lo") == lo and s.get("hi") == hi
                     and s.get("total_rows") == self.total_rows[layer]]
            if not match:
                continue  # a host may serve a declared subset: this layer is read elsewhere
            want = self.digests.get(layer)
            if want and match[0].get("digest") != want:
                self.stats.add("manifest_rejections")
                raise ManifestMismatch(f"layer {layer}: server digest {match[0].get('digest')} "
                                       f"!= local shard {want}")
            regions[layer] = match[0]["region"]
        if not regions:
            self.stats.add("manifest_rejections")
            wanted = ", ".join(f"layer {k} rows [{lo}, {hi})" for k, (lo, hi) in self.ranges.items())
            raise ManifestMismatch(f"server has none of rank {self.rank}'s shards ({wanted})")
        return regions

    # -- reads ----------------------------------------------------------------------------
    def gather(self, layer: int, uniq: np.ndarray, into: Region) -> bool:
        """Rows `uniq` of `layer` into `into` from a healthy host, failing over within one
        deadline; False when none answered (the caller reads the local shard)."""
        with self._lock:
            live = [h for h in self.hosts if h.state == HEALTHY]
            start, self._next = self._next, self._next + 1
        if not live:
            self.stats.add("backoff_skips")
            return False
        offsets = (uniq - self.ranges[layer][0]).astype(np.uint64) * ROW_BYTES
        deadline = time.monotonic() + self.deadline_s
        order = live[start % len(live):] + live[:start % len(live)]
        failed = False  # a host of this read failed: a later one's answer is a failover
        for i, host in enumerate(order):
            # each host its share of what is left, so a stalled one leaves time to fail over
            share = (deadline - time.monotonic()) / (len(order) - i)
            if share <= 0:
                break
            try:
                if not host.conn.connected:
                    host.conn.ensure_connected(share)  # its manifest sets its regions
                if layer not in host.regions:
                    continue  # this host does not serve the layer
                host.conn.gather(host.regions[layer], offsets, ROW_BYTES, into=into, deadline_s=share)
            except OflError as exc:
                failed = True
                self._set_aside(host, exc)
                continue
            host.rows += uniq.size
            if failed:
                self.stats.add("failovers")
            return True
        # every host that could serve it failed (a fallback), or none serves the layer now
        self.stats.add("fallbacks" if failed else "backoff_skips")
        return False

    def _set_aside(self, host: Host, exc: Exception) -> None:
        """A failed read: aside until it qualifies again; other tables: quarantined."""
        quarantine = isinstance(exc, (PeerRejected, ManifestMismatch))
        with self._lock:
            host.state, host.reason = (QUARANTINED if quarantine else FAILED), f"{type(exc).__name__}: {exc}"
            host.since = time.time()
        self.stats.add("quarantines" if quarantine else "remote_failures")
        log.warning("Engram rank %d: host %s %s (%s)%s", self.rank, host.address,
                    "quarantined" if quarantine else "failed", exc,
                    "" if quarantine else f"; re-checked every {self.recheck_s:g} s")

    # -- readmission ----------------------------------------------------------------------
    def _recheck_loop(self) -> None:
        while not self._stop.wait(self.recheck_s):
            for host in [h for h in self.hosts if h.state == FAILED]:
                if self._stop.is_set():
                    return
                self._recheck(host)

    def _recheck(self, host: Host) -> None:
        """Reconnect a host set aside and compare a sample of its rows with the local
        shards: equal -> readmitted; different -> quarantined; unreachable -> stays aside."""
        conn = self._connection(host)
        try:
            conn.ensure_connected(RECHECK_DEADLINE_S)
            why = self._rows_differ(conn, host.regions)
        except OflError as exc:
            conn.close()
            if isinstance(exc, PeerRejected):
                self._set_aside(host, exc)
            else:
                host.reason = f"{type(exc).__name__}: {exc}"  # still unreachable: stays aside
            return
        if why:
            conn.close()
            self._set_aside(host, ManifestMismatch(why))
            return
        with self._lock:
            old, host.conn = host.conn, conn
            host.state, host.reason, host.since = HEALTHY, "readmitted: its rows equal the local shards", time.time()
        old.close()
        self.stats.add("readmissions")
        log.warning("Engram rank %d: host %s readmitted (its rows equal the local shards)",
                    self.rank, host.address)

    def _rows_differ(self, conn: Connection, regions: dict[int, str]) -> str:
        """Why the host's rows are not the local shards' ('' when equal or nothing to compare)."""
        rng = np.random.default_rng()
        dest = Region.allocate("engram-recheck", (RECHECK_SAMPLE + 2) * ROW_BYTES)
        try:
            for layer, region in regions.items():
                reader = self.local.get(layer)
                if reader is None:
                    continue
                lo, hi = self.ranges[layer]
                ids = np.unique(np.concatenate([[lo, hi - 1], rng.integers(lo, hi, RECHECK_SAMPLE)]))
                bad = mismatched_rows(conn, region, reader, ids, dest, RECHECK_DEADLINE_S)
                if bad.size:
                    return f"layer {layer}: {bad.size} of {ids.size} sampled rows differ from the " \
                           f"local shard (first: row {int(bad[0])})"
        finally:
            dest.close()
        return ""

    # -- operations -----------------------------------------------------------------------
    def status(self) -> list[dict]:
        with self._lock:
            return [h.status() for h in self.hosts]

    def prometheus(self) -> str:
        """One gauge per host: 1 while it serves this rank's reads, with its state."""
        lines = ["# HELP engram_client_host_healthy 1 while the offload host serves this rank's reads",
                 "# TYPE engram_client_host_healthy gauge"]
        lines += [f'engram_client_host_healthy{{rank="{self.rank}",host="{h["address"]}",'
                  f'state="{h["state"]}"}} {int(h["state"] == HEALTHY)}' for h in self.status()]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._stop.set()
        self._checker.join(timeout=30)
        for host in self.hosts:
            host.conn.close()
