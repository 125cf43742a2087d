"""The remote Engram overlay against vLLM's own DeepSeek-V4.1 Engram code, on CPU.

Run by test_engram_vllm.py with vLLM's interpreter, one process per tensor-parallel rank:
  python vllm_engram_check.py --prime-start P --vocab V --rank R --nranks N --out F.npz
(ENGRAM_REMOTE / ENGRAM_SHARD_DIR set as for an engine). vLLM's model code needs CUDA, so
this drives its classes at the function level: `ParallelEngramEmbedding.__init__` with the
CUDA device query and the parallel state answered for this rank, and its lookup kernel's
own source run under Triton's interpreter. It checks, for every layer and both forms of
`out`: the stock table (weights loaded by vLLM's loader, the kernel) == the overlay's table
(no rows allocated; rows from EngramClient) == the overlay's prefetch path through
`Engram.prepare_embeddings` / `_ready_rows`. Exits non-zero on any difference.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch import nn  # noqa: E402
from vllm.models.deepseek_v41.common import engram as E  # noqa: E402

from remote_engram.geometry import EngramGeometry  # noqa: E402
from remote_engram.synth import synthetic_rows  # noqa: E402
from remote_engram.vllm import overlay  # noqa: E402
from remote_engram.vllm.hashing import row_ids  # noqa: E402

LAYERS = (1, 14)


def interpreted(kernel):
    """vLLM on CPU replaces Triton with placeholders: re-create the kernel from its source."""
    scope = {"triton": triton, "tl": tl, "_SORTED_IS_CONSTEXPR": False}
    exec(inspect.getsource(kernel), scope)
    return scope[kernel.__name__]


def answer_as_rank(rank: int, nranks: int) -> None:
    E.get_tensor_model_parallel_rank = lambda: rank
    E.get_tensor_model_parallel_world_size = lambda: nranks
    E.get_engram_dp_size = lambda: 1
    torch.cuda.get_device_properties = lambda index: SimpleNamespace(multi_processor_count=8)
    torch.accelerator.current_device_index = lambda: 0
    overlay.tp_rank_size = lambda: (rank, nranks)
    E._engram_lookup_kernel = interpreted(E._engram_lookup_kernel)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--prime-start", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--nranks", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    answer_as_rank(args.rank, args.nranks)
    geometry = EngramGeometry(layers=LAYERS, vocab=args.vocab, prime_start=args.prime_start)
    layout = E.EngramLayout(SimpleNamespace(
        engram_layer_ids=list(LAYERS), engram_num_embeddings=[geometry.rows(x) for x in LAYERS],
        engram_max_ngram_size=geometry.max_order, engram_n_heads=geometry.heads,
        engram_head_dim=256, engram_compressed_vocab_size=args.vocab,
        engram_vocab_size=args.prime_start, engram_pad_token_id=2))
    tokens = torch.from_numpy(np.random.default_rng(5).integers(0, args.vocab, (1, 40)))
    results, failures = {}, []
    tables = []
    for i, layer in enumerate(LAYERS):
        heads = tuple(p for order in layout.primes[i] for p in order)
        stock = E.ParallelEngramEmbedding(layout.num_embeddings[i], 256, heads)
        full = torch.from_numpy(synthetic_rows(0, layer, 0, geometry.rows(layer)))
        stock._weight_loader(stock.weight, full[:, :256].contiguous().view(torch.float8_e4m3fn))
        stock._weight_loader(stock.weight_scale_inv,
                             full[:, 256:].contiguous().view(torch.float8_e8m0fnu))
        ids = row_ids(geometry, layer, tokens, torch.arange(args.vocab))[0].int()
        ids[::7] = E.DEAD_ID  # rows no head owns read as zeros
        wants = {}
        for dtype, width in ((torch.bfloat16, 256), (torch.uint8, 264)):
            wants[dtype] = torch.full((ids.shape[0], stock.part_n_hash_cols, width), 7, dtype=dtype)
            stock.lookup(ids, wants[dtype])  # vLLM's kernel, before the overlay is installed
        tables.append((i, layer, heads, full, ids, wants))

    overlay.install(E.ParallelEngramEmbedding, E.Engram)
    for i, layer, heads, full, ids, wants in tables:
        table = overlay.attach(E.ParallelEngramEmbedding(layout.num_embeddings[i], 256, heads),
                               layout, i)
        if table.weight.shape[0] or table.weight_scale_inv.shape[0]:
            failures.append(f"layer {layer}: the overlay's table allocated rows")
        table._weight_loader(table.weight, full[:, :256])  # skipped, counted
        engram = object.__new__(E.Engram)
        nn.Module.__init__(engram)
        engram.embed_tokens = table
        engram.staged_rows = torch.full((ids.shape[0], table.part_n_hash_cols, 256), 3.0,
                                        dtype=torch.bfloat16)
        engram.prepare_embeddings(ids)
        prefetched = engram._ready_rows(ids.shape[0])
        for form, dtype in (("bf16", torch.bfloat16), ("packed", torch.uint8)):
            want = wants[dtype]
            got = torch.full_like(want, 5)
            table.lookup(ids, got)
            if not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
                failures.append(f"layer {layer} {form}: the overlay's rows differ from vLLM's")
            if form == "bf16" and not torch.equal(want, prefetched):
                failures.append(f"layer {layer}: prepare_embeddings/_ready_rows rows differ")
            if form == "packed":
                results[f"l{layer}"] = got.numpy()
    np.savez(args.out, **results)
    counters = overlay._Rank.client.stats.snapshot()
    print(json.dumps({"rank": args.rank, "nranks": args.nranks, "failures": failures,
                      "counters": counters}))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
