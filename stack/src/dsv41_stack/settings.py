"""Every STACK_* variable the launcher reads from an env file, with its default and what it
does. The components' own variables (ENGRAM_*, REMOTE_DRAFTER_*, VLLM_DSPARK_REMOTE_ASYNC,
ASYNC_HANDOFF_*, OFL_*) go in the same file and are passed to the processes that read them
(`dsv41-stack args` shows which process gets what)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    doc: str


SETTINGS = [
    Setting("STACK_RUN_DIR", ".artifacts/stack",
            "Logs, pid files and results of this machine's roles."),
    Setting("STACK_MODEL", "", "The target checkpoint folder (the engine serves it; the drafter's "
            "identity is checked against it)."),
    Setting("STACK_VLLM_PYTHON", "python3", "The interpreter that has vLLM and the overlays."),
    Setting("STACK_ENGINE_LISTEN", "127.0.0.1:8000", "HOST:PORT of rank 0's OpenAI server."),
    Setting("STACK_TP", "1", "Tensor-parallel size of the engine (2 on the Sparks)."),
    Setting("STACK_KV_BYTES", "1073741824", "KV cache budget per rank, bytes (--kv-cache-memory-bytes)."),
    Setting("STACK_KV_BYTES_BASELINE", "", "The KV budget with the drafter inside the engine: what "
            "`rollback remote-drafter` restores (3.75 GiB in the reference); empty = keep."),
    Setting("STACK_MAX_MODEL_LEN", "2048", "Longest request, tokens (327,680 in the reference)."),
    Setting("STACK_MAX_NUM_SEQS", "4", "Concurrent sequences (4 in the reference)."),
    Setting("STACK_DTYPE", "float32", "Engine dtype (float32 on CPU; bfloat16 on the Sparks)."),
    Setting("STACK_ENFORCE_EAGER", "0", "1 = no compilation or graphs (the CPU miniature)."),
    Setting("STACK_NUM_SPEC_TOKENS", "5", "Draft tokens per step (batch-aware depth lowers it: "
            "REMOTE_DRAFTER_DEPTH); 0 = no speculation."),
    Setting("STACK_ENGRAM_SHARDS", "", "Offload host: folder of the Engram shards it serves."),
    Setting("STACK_ENGRAM_LISTEN", "", "Offload host: Engram server links, HOST:PORT per rank, "
            "comma-separated; empty = no Engram server."),
    Setting("STACK_DRAFTER", "", "Offload host: the drafter the worker serves (checkpoint folder, "
            "'ngram', 'module:Class'); empty = no worker."),
    Setting("STACK_DRAFTER_TARGET", "", "Offload host: the target folder the drafter was built "
            "for (its embedding, head and identity); empty = STACK_MODEL."),
    Setting("STACK_DRAFTER_LISTEN", "", "Offload host: HOST:PORT of the drafter worker."),
    Setting("STACK_DRAFTER_DEVICE", "cpu", "Offload host: the worker's device (cuda:0 on the 3090)."),
    Setting("STACK_INJECT_DELAY_MS", "0", "Miniature only: delay added to every Engram read and "
            "drafter round, a slow link on one machine."),
]
BY_NAME = {s.name: s for s in SETTINGS}
COMPONENT_PREFIXES = ("ENGRAM_", "REMOTE_DRAFTER_", "VLLM_DSPARK_", "ASYNC_HANDOFF_", "OFL_")
