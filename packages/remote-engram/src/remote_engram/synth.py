"""Synthetic Engram tables of any geometry, for tests and demos: a safetensors checkpoint
(F8_E4M3 weights, F8_E8M0 scales) or shards written directly. Bytes are a function of
(seed, layer, row), so any row can be recomputed without the file."""

from __future__ import annotations

import os

import numpy as np
from safetensors import TensorSpec, serialize_file

from .geometry import ROW_BYTES, VALUES_PER_ROW, EngramGeometry
from .pack import CHUNK_ROWS
from .shard import ShardHeader, ShardWriter, shard_name


def synthetic_rows(seed: int, layer: int, first: int, count: int) -> np.ndarray:
    """[count, 264] rows: finite E4M3 values (no NaN code) and scales near 2^0."""
    i = np.arange(first, first + count, dtype=np.uint64)[:, None]
    col = np.arange(ROW_BYTES, dtype=np.uint64)[None, :]
    x = (i * np.uint64(0x9E3779B97F4A7C15) + col * np.uint64(0xBF58476D1CE4E5B9)
         + np.uint64(seed * 1_000_003 + layer)) >> np.uint64(29)
    rows = (x & np.uint64(0xFF)).astype(np.uint8)
    values = rows[:, :VALUES_PER_ROW]
    values[(values & 0x7F) == 0x7F] ^= 1  # 0x7F / 0xFF are E4M3 NaN
    rows[:, VALUES_PER_ROW:] = 120 + rows[:, VALUES_PER_ROW:] % 16  # 2^-7 .. 2^8
    return rows


def write_checkpoint(path: str, geometry: EngramGeometry, seed: int = 0) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tensors, keep = {}, []
    for layer in geometry.layers:
        rows = synthetic_rows(seed, layer, 0, geometry.rows(layer))
        weight = np.ascontiguousarray(rows[:, :VALUES_PER_ROW])
        scale = np.ascontiguousarray(rows[:, VALUES_PER_ROW:])
        keep += [weight, scale]
        for name, arr, dtype in ((f"layers.{layer}.engram.embed.weight", weight, "float8_e4m3fn"),
                                 (f"layers.{layer}.engram.embed.scale", scale, "float8_e8m0fnu")):
            tensors[name] = TensorSpec(dtype=dtype, shape=list(arr.shape),
                                       data_ptr=arr.ctypes.data, data_len=arr.nbytes)
    serialize_file(tensors, path)
    del keep


def write_shards(out_dir: str, geometry: EngramGeometry, nranks: int = 2, seed: int = 0) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for layer in geometry.layers:
        for rank in range(nranks):
            lo, hi = geometry.rank_rows(layer, rank, nranks)
            path = os.path.join(out_dir, shard_name(layer, rank, nranks))
            with ShardWriter(path, ShardHeader(layer, lo, hi, geometry.rows(layer))) as w:
                for start in range(lo, hi, CHUNK_ROWS):
                    n = min(CHUNK_ROWS, hi - start)
                    w.write_rows(start, synthetic_rows(seed, layer, start, n))
            paths.append(path)
    return paths
