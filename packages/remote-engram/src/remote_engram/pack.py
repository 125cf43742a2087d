"""Pack Engram tables from a safetensors checkpoint into shards, and check shards against it.

The checkpoint holds, per layer L, `layers.{L}.engram.embed.weight` (F8_E4M3 [rows, 256])
and `layers.{L}.engram.embed.scale` (F8_E8M0 [rows, 8]). A shard row is the weight row's
256 bytes followed by the scale row's 8 bytes, unchanged. numpy has no FP8 dtypes, so the
tensors are mapped as raw bytes at the offsets the safetensors header gives.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable

import numpy as np

from .geometry import ROW_BYTES, SCALES_PER_ROW, VALUES_PER_ROW, EngramGeometry
from .shard import ShardHeader, ShardReader, ShardWriter, shard_name

WEIGHT = "layers.{layer}.engram.embed.weight"
SCALE = "layers.{layer}.engram.embed.scale"
CHUNK_ROWS = 1 << 18  # 66 MiB of rows per copy step


class Checkpoint:
    """Raw byte views of a safetensors file's tensors (read-only mmap, no copies)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"{self.path}: safetensors header of {n} bytes is implausible")
            self.index = json.loads(f.read(n))
        self.data_start = 8 + n
        fd = os.open(self.path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)

    def raw(self, name: str, dtype: str, width: int) -> np.ndarray:
        """Tensor `name` as uint8 [rows, width], after checking its dtype and shape."""
        if name not in self.index:
            raise KeyError(f"{self.path} has no tensor {name!r}")
        meta = self.index[name]
        if meta["dtype"] != dtype or len(meta["shape"]) != 2 or meta["shape"][1] != width:
            raise ValueError(f"{name}: expected {dtype} [rows, {width}], got {meta['dtype']} "
                             f"{meta['shape']}")
        start, end = meta["data_offsets"]
        rows = meta["shape"][0]
        if end - start != rows * width:
            raise ValueError(f"{name}: {end - start} bytes for {rows} x {width}")
        return np.frombuffer(self._mm, np.uint8, count=end - start,
                             offset=self.data_start + start).reshape(rows, width)

    def tables(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        weight = self.raw(WEIGHT.format(layer=layer), "F8_E4M3", VALUES_PER_ROW)
        scale = self.raw(SCALE.format(layer=layer), "F8_E8M0", SCALES_PER_ROW)
        if len(weight) != len(scale):
            raise ValueError(f"layer {layer}: {len(weight)} weight rows but {len(scale)} scale rows")
        return weight, scale


def rows_of(weight: np.ndarray, scale: np.ndarray, lo: int, hi: int) -> np.ndarray:
    out = np.empty((hi - lo, ROW_BYTES), np.uint8)
    out[:, :VALUES_PER_ROW] = weight[lo:hi]
    out[:, VALUES_PER_ROW:] = scale[lo:hi]
    return out


def pack(checkpoint: str, out_dir: str, geometry: EngramGeometry, nranks: int = 2,
         progress: Callable[[str, int, int], None] | None = None) -> list[str]:
    """Write one shard per (layer, rank); returns their paths."""
    ck = Checkpoint(checkpoint)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for layer in geometry.layers:
        weight, scale = ck.tables(layer)
        if len(weight) != geometry.rows(layer):
            raise ValueError(f"layer {layer}: checkpoint has {len(weight)} rows, the geometry "
                             f"{geometry.rows(layer)}")
        for rank in range(nranks):
            lo, hi = geometry.rank_rows(layer, rank, nranks)
            path = os.path.join(out_dir, shard_name(layer, rank, nranks))
            with ShardWriter(path, ShardHeader(layer, lo, hi, len(weight))) as w:
                for start in range(lo, hi, CHUNK_ROWS):
                    end = min(start + CHUNK_ROWS, hi)
                    w.write_rows(start, rows_of(weight, scale, start, end))
                    if progress:
                        progress(os.path.basename(path), end - lo, hi - lo)
            paths.append(path)
    return paths


def check(shard_path: str, checkpoint: str) -> list[str]:
    """Differences between a shard and its source checkpoint; empty when identical."""
    problems = []
    with ShardReader(shard_path) as shard:
        weight, scale = Checkpoint(checkpoint).tables(shard.layer)
        if shard.header.total_rows != len(weight):
            problems.append(f"total_rows {shard.header.total_rows} != checkpoint {len(weight)}")
            return problems
        for start in range(shard.lo, shard.hi, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, shard.hi)
            got = shard.table[start - shard.lo:end - shard.lo]
            bad = np.flatnonzero((got != rows_of(weight, scale, start, end)).any(axis=1))
            if bad.size:
                problems.append(f"{bad.size} rows differ in [{start}, {end}), first {start + bad[0]}")
    return problems
