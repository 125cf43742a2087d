"""Qualify a link before enabling remote Engram: the server's rows, read over the link,
must equal the local shards byte for byte (a sample, or every row)."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ofl import Connection, Region

from .geometry import ROW_BYTES
from .shard import ShardReader

CHUNK = 1 << 14  # rows per gather when comparing everything


def mismatched_rows(conn: Connection, region: str, local: ShardReader, ids: np.ndarray,
                    dest: Region, deadline_s: float | None = None,
                    progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """The ids among `ids` (global, of `local`'s range) whose rows on the server's `region`
    differ from the local shard's; `dest` holds a chunk of rows. progress(done, total) after
    each chunk."""
    bad = []
    chunk = dest.length // ROW_BYTES
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        conn.gather(region, (part - local.lo).astype(np.uint64) * ROW_BYTES, ROW_BYTES, into=dest,
                    deadline_s=deadline_s)
        got = dest.array[:len(part) * ROW_BYTES].reshape(len(part), ROW_BYTES)
        bad.append(part[(got != local.rows(part)).any(axis=1)])
        if progress is not None:
            progress(start + len(part), len(ids))
    return np.concatenate(bad) if bad else np.empty(0, np.int64)


def qualify_link(address: str, backend: str, shard_paths: list[str], *, sample: int = 100_000,
                 all_rows: bool = False, seed: int = 0, link: str = "",
                 progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Compare rows of each local shard with the server's copy over one link; with no local
    shard there is nothing to compare, and the link is not qualified. progress(shard, rows
    compared, rows to compare) as it goes."""
    report = {"link": link, "address": address, "backend": backend, "shards": [], "ok": True}
    if not shard_paths:
        return {**report, "ok": False, "error": "no local shard for this link: nothing was compared"}
    conn = Connection(address, backend=backend, link=link or None, identity="engram-qualify")
    rng = np.random.default_rng(seed)
    dest = Region.allocate("qualify", CHUNK * ROW_BYTES)
    try:
        manifest = conn.peer_metadata.get("shards", [])
        for path in shard_paths:
            with ShardReader(path) as local:
                h = local.header
                entry = next((s for s in manifest if (s.get("layer"), s.get("lo"), s.get("hi"))
                              == (h.layer, h.lo, h.hi)), None)
                res = {"shard": os.path.basename(path), "layer": h.layer, "rows_compared": 0,
                       "mismatched_rows": 0, "first_mismatch": None,
                       "digest_equal": bool(entry and entry.get("digest") == local.digest())}
                if entry is None:
                    res["error"] = "the server has no shard with this layer and row range"
                    report["ok"] = False
                    report["shards"].append(res)
                    continue
                if all_rows:
                    ids = np.arange(h.lo, h.hi, dtype=np.int64)
                else:
                    ids = np.unique(np.concatenate([
                        [h.lo, h.hi - 1], rng.integers(h.lo, h.hi, min(sample, h.rows))]))
                name = f"{link + ' ' if link else ''}{os.path.basename(path)}"
                bad = mismatched_rows(conn, entry["region"], local, ids, dest, progress=progress and (
                    lambda done, total, name=name: progress(name, done, total)))
                res["rows_compared"] = len(ids)
                res["mismatched_rows"] = int(bad.size)
                res["first_mismatch"] = int(bad[0]) if bad.size else None
                if res["mismatched_rows"] or not res["digest_equal"]:
                    report["ok"] = False
                report["shards"].append(res)
    finally:
        dest.close()
        conn.close()
    return report
