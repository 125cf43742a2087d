"""Every STACK_* variable the launcher reads from an env file, with its default and what it
does. The components' own variables (ENGRAM_*, REMOTE_DRAFTER_*, VLLM_DSPARK_REMOTE_ASYNC,
ASYNC_HANDOFF_*, OFL_*, DRAFTER_TP2_*) go in the same file and are passed to the processes that read them
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
    Setting("STACK_ENGINE_NODES", "1", "Hosts the engine spans, one vLLM process each (vLLM "
            "--nnodes, no Ray): 1 = every rank on this host; 2 = TP2 across the two Sparks, "
            "each started with `--role engine --rank N`: rank 0 serves the OpenAI API, rank 1 "
            "runs vLLM's headless worker. Must divide STACK_TP."),
    Setting("STACK_ENGINE_MASTER", "", "STACK_ENGINE_NODES > 1: HOST:PORT on rank 0's host where "
            "the ranks meet (vLLM --master-addr/--master-port: torch.distributed's store, opened "
            "by rank 0), reachable from every engine host; required then."),
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
    Setting("STACK_DRAFTER_DTYPE", "float32", "Offload host: the weights' type on the worker's "
            "card(s): float32, bfloat16 or float16 (both kinds of worker; the identities do not "
            "change, `remote-drafter shadow` notes the difference)."),
    Setting("STACK_DRAFTER_TP2", "0", "Offload host: 1 = the worker is drafter-tp2's two-card "
            "tensor-parallel worker on STACK_DRAFTER_DEVICES, supervised (`drafter-tp2 supervise "
            "-- worker ...`; DSpark checkpoints only), same listener, drafter and target as the "
            "one-card worker; 0 = the one-card worker on STACK_DRAFTER_DEVICE. Rollback: "
            "`dsv41-stack rollback tp2-worker`, at the worker's restart."),
    Setting("STACK_DRAFTER_DEVICES", "cuda:0,cuda:1", "Offload host, STACK_DRAFTER_TP2=1: the "
            "pair's two distinct devices, rank 0's first (cpu:0,cpu:1 runs it on CPU, gloo)."),
    Setting("STACK_INJECT_DELAY_MS", "0", "Miniature only: delay added to every Engram read and "
            "drafter round, a slow link on one machine."),
]
BY_NAME = {s.name: s for s in SETTINGS}
ENGINE_PREFIXES = ("ENGRAM_", "REMOTE_DRAFTER_", "VLLM_DSPARK_", "ASYNC_HANDOFF_", "OFL_")
# DRAFTER_TP2_*: the two-card worker's own variables (drafter-tp2 env), for the offload host
COMPONENT_PREFIXES = (*ENGINE_PREFIXES, "DRAFTER_TP2_")
