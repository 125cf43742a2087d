"""Which vLLM code the plugin relies on: the methods register() wraps (HOOKS, checked in a
release by tools/check-vllm-hooks.py) and digests of the functions whose behaviour deferred
collection and one round per TP group depend on; another vLLM falls back, saying why."""

from __future__ import annotations

import hashlib
import inspect

# What register() wraps, as vLLM 0.32 / 0.33 define it: {file: {class: {method: leading
# parameters}}}. tools/check-vllm-hooks.py checks a vLLM release against it.
HOOKS = {"vllm/v1/worker/gpu_model_runner.py": {"GPUModelRunner": {
    "propose_draft_token_ids": ["self", "scheduler_output", "sampled_token_ids",
                                "sampling_metadata", "hidden_states", "sample_hidden_states",
                                "aux_hidden_states"],
    "take_draft_token_ids": ["self"],
    "_update_states": ["self", "scheduler_output"],
    "_setup_eagle3_aux_hidden_state_outputs": ["self"]}}}
# Deferred collection relies on the code of these functions as vLLM 0.32.0 and 0.33.0 have
# it (the same in both): where the scheduled drafts enter the input batch and where the
# batch is read. source_digest of each; another vLLM gets collection at take, saying why.
DEFERRED_SOURCES = {
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", "_update_states"): "1d3a025137b5fd9e",
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", "execute_model"): "19c4bcd6969eb0df",
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", "_prepare_inputs"): "5dc7641a34ad577b",
    ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner", "take_draft_token_ids"): "608a48cfe33ceacc",
    ("vllm/v1/worker/gpu_input_batch.py", "InputBatch", "update_req_spec_token_ids"): "7529faa1b955fda8",
}
# One round per TP group relies on vLLM's multiprocessing executor taking the drafts from TP
# rank 0 alone (its output rank), as 0.32.0 and 0.33.0 have it; another vLLM gets a round
# per rank, and deferral is refused under TP.
SHARED_SOURCES = {
    ("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor", "_get_output_rank"): "82a750d1541e6ba5",
    ("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor", "take_draft_token_ids"): "8f25b3fd120e84c7",
}


def source_digest(source: str) -> str:
    """A function's source, from its `def` line, blank lines and indentation left out: the
    same from inspect.getsource (at run time) and from a release's file (the hook checker)."""
    lines = [line.strip() for line in source.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.startswith("def "))
    return hashlib.sha256("\n".join(lines[start:]).encode()).hexdigest()[:16]


def refusal(sources: dict) -> str | None:
    """Why this vLLM's code differs from `sources` (DEFERRED_SOURCES, SHARED_SOURCES; None:
    it does not)."""
    import importlib
    for (path, cls, name), digest in sources.items():
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        got = source_digest(inspect.getsource(getattr(getattr(module, cls), name)))
        if got != digest:
            return f"{cls}.{name} differs from the vLLM releases checked (digest {got}, want {digest})"
    return None
