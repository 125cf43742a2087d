"""The remote Engram overlay: vLLM's Engram tables read through EngramClient instead of
device or host memory (ARCHITECTURE.md § Engram in vLLM).

Switched on by ENGRAM_REMOTE (the offload host, one link per tensor-parallel rank) and/or
ENGRAM_SHARD_DIR (the exact local fallback; alone it is the local shard reader); inert when
both are unset. What it changes, per table class / Engram module class it is installed on:
* `_allocate_weights` allocates no rows and the tables' checkpoint tensors are skipped
  (counted), so the engine holds none of the tables;
* `_create_embedding` attaches a `RemoteRows` (this rank's head range and layer);
* `prepare_embeddings` (forward entry, where the row ids are computed) starts the fetch;
  `_ready_rows` (where a layer consumes its rows) waits for it, and the wait is counted;
* `lookup` (any other caller) fetches and fills `out` in place before returning.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time

import numpy as np
import torch

from .. import env
from ..client import EngramClient
from ..geometry import ROW_BYTES, VALUES_PER_ROW, EngramGeometry
from .lookup import HeadRange, write_rows

log = logging.getLogger("vllm.remote_engram")  # under vLLM's logger: its handlers print it
_MARK = "_remote_engram_overlay"


def enabled() -> bool:
    return bool(env.ENGRAM_REMOTE.get() or env.ENGRAM_HOSTS.get() or env.ENGRAM_SHARD_DIR.get())


def geometry_of(layout) -> EngramGeometry:
    """Our geometry for vLLM's EngramLayout; refuses a layout whose tables differ."""
    geometry = EngramGeometry(layers=tuple(layout.layer_ids), vocab=layout.compressed_vocab_size,
                              orders=tuple(range(2, layout.max_ngram_size + 1)),
                              heads=layout.n_heads,
                              prime_start=int(min(min(p) for p in layout.primes[0])))
    for i, layer in enumerate(geometry.layers):
        primes = [p for order in layout.primes[i] for p in order]
        if primes != geometry.primes[layer].tolist() or \
                layout.num_embeddings[i] != geometry.rows(layer):
            raise ValueError(f"Engram layer {layer}: vLLM's table layout differs from the "
                             "offload host's geometry (primes or row count)")
    if layout.head_dim != VALUES_PER_ROW:
        raise ValueError(f"Engram head_dim {layout.head_dim}: the shards hold {VALUES_PER_ROW}")
    return geometry


class RemoteRows:
    """One layer's reads for one rank: started at forward entry, finished where consumed
    (with `prefetch` off the fetch itself waits until then)."""

    def __init__(self, client: EngramClient, layer: int, heads: HeadRange, prefetch: bool = True):
        self.client, self.layer, self.heads, self.prefetch = client, layer, heads, prefetch
        self._pending = self._deferred = None

    def start(self, indices: torch.Tensor, out: torch.Tensor, now: bool | None = None) -> None:
        self.finish()  # one lookup in flight per layer: a new step completes the last one
        if not (self.prefetch if now is None else now):
            self._deferred = (indices, out)
            return
        ids, owned = self.heads.owned(indices.detach().to("cpu"))
        future = self.client.fetch_async(self.layer, ids[owned].numpy())
        self._pending = (future, owned, out)

    def finish(self) -> None:
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self.start(*deferred, now=True)
        if self._pending is None:
            return
        future, owned, out = self._pending
        self._pending = None
        t = time.perf_counter()
        fetched = future.result()
        self.client.stats.add("overlay_wait_us", int((time.perf_counter() - t) * 1e6))
        self.client.stats.add("overlay_lookups")
        rows = torch.zeros(*owned.shape, ROW_BYTES, dtype=torch.uint8)
        rows[owned] = torch.from_numpy(np.ascontiguousarray(fetched))
        write_rows(rows, out)


class _Rank:
    """The process's one EngramClient (per tensor-parallel rank), made on first use."""

    lock = threading.Lock()
    client: EngramClient | None = None
    http = None

    @classmethod
    def client_for(cls, layout, rank: int, nranks: int) -> EngramClient:
        with cls.lock:
            if cls.client is None:
                cls.client = EngramClient(geometry=geometry_of(layout), rank=rank, nranks=nranks)
                log.info("remote Engram overlay: rank %d of %d, offload hosts %s, shards %r", rank,
                         nranks, env.hosts_for_rank(rank), env.ENGRAM_SHARD_DIR.get())
                if listen := env.ENGRAM_METRICS_LISTEN.get():
                    cls.http = _serve_metrics(cls.client, listen, rank)
            return cls.client


def _serve_metrics(client: EngramClient, listen: str, rank: int):
    from ofl.http import MetricsServer
    from ofl.server import parse_address

    host, port = parse_address(listen, 9490)
    return MetricsServer(host, port + rank, client.prometheus,
                         lambda: {"rank": rank, "counters": client.stats.snapshot(),
                                  "hosts": client.host_status()},
                         name=f"engram-client-r{rank}")


def _skip_table_weights(param, loaded_weight) -> None:
    if _Rank.client is not None:
        _Rank.client.stats.add("table_bytes_not_loaded", loaded_weight.numel()
                               * loaded_weight.element_size())


def attach(table, layout, layer_hash_index: int):
    """Give a new table this rank's RemoteRows (its layer, head range and link)."""
    if getattr(table, "dp_size", 1) != 1:
        raise ValueError("the remote Engram overlay does not take DP-sharded tables")
    rank, size = tp_rank_size()
    client = _Rank.client_for(layout, rank, size)
    layer = layout.layer_ids[layer_hash_index]
    heads = HeadRange.of(table)
    if (heads.lo, heads.hi) != client.ranges[layer]:
        raise ValueError(f"Engram layer {layer} rank {rank}: vLLM reads rows "
                         f"[{heads.lo}, {heads.hi}), the shards hold {client.ranges[layer]}")
    table.remote_rows = RemoteRows(client, layer, heads, env.ENGRAM_PREFETCH.get() != "0")
    return table


def tp_rank_size() -> tuple[int, int]:
    """This engine process's tensor-parallel (rank, world size)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


# What the overlay replaces, as vLLM 0.32 / 0.33 define it (vllm/models/deepseek_v41/common/
# engram.py). install() refuses classes that differ: a changed hook fails loudly, not subtly.
HOOKS = {
    "table": {"lookup": ["self", "indices", "out", "background"], "_allocate_weights": ["self"],
              "_weight_loader": ["param", "loaded_weight"]},
    "engram": {"_create_embedding": ["self", "layout", "layer_hash_index"],
               "prepare_embeddings": ["self", "hash_ids"], "_ready_rows": ["self", "num_tokens"]},
}


def check_hooks(table_cls: type, engram_cls: type) -> None:
    for kind, cls in (("table", table_cls), ("engram", engram_cls)):
        for name, params in HOOKS[kind].items():
            got = list(inspect.signature(getattr(cls, name)).parameters) \
                if hasattr(cls, name) else None
            if got != params:
                raise RuntimeError(f"remote Engram overlay: {cls.__qualname__}.{name} is "
                                   f"{got}, the overlay was written for {params}; this vLLM "
                                   "version is not supported (unset ENGRAM_REMOTE and "
                                   "ENGRAM_SHARD_DIR to run without the overlay)")


def install(table_cls: type, engram_cls: type) -> bool:
    """Patch a table class and its Engram module class; idempotent (vLLM loads general
    plugins in every process). Returns whether it patched now."""
    if getattr(table_cls, _MARK, False):
        return False
    check_hooks(table_cls, engram_cls)

    def allocate_nothing(self):
        scale_dim = self.dim // self.block_size
        return (torch.empty(0, self.dim, dtype=torch.float8_e4m3fn),
                torch.empty(0, scale_dim, dtype=torch.uint8))

    def lookup(self, indices, out, background=False):
        self.remote_rows.start(indices, out, now=True)
        self.remote_rows.finish()

    create = engram_cls._create_embedding

    def create_embedding(self, layout, layer_hash_index):
        return attach(create(self, layout, layer_hash_index), layout, layer_hash_index)

    ready = engram_cls._ready_rows

    def prepare_embeddings(self, hash_ids):
        self.embed_tokens.remote_rows.start(hash_ids, self.staged_rows[:hash_ids.shape[0]])

    def ready_rows(self, num_tokens):
        self.embed_tokens.remote_rows.finish()
        return ready(self, num_tokens)

    table_cls._allocate_weights = allocate_nothing
    table_cls._weight_loader = staticmethod(_skip_table_weights)
    table_cls.lookup = lookup
    engram_cls._create_embedding = create_embedding
    engram_cls.prepare_embeddings = prepare_embeddings
    engram_cls._ready_rows = ready_rows
    setattr(table_cls, _MARK, True)
    return True
