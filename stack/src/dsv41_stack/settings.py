"""Every STACK_* variable the launcher reads from an env file, with its default and what it
does, declared as the components declare theirs (ofl's EnvVar; the launcher reads them from
env files, not from its own environment). The components' own variables (ENGRAM_*,
REMOTE_DRAFTER_*, VLLM_DSPARK_REMOTE_ASYNC, ASYNC_HANDOFF_*, OFL_*, DRAFTER_TP2_*) go in the
same file and are passed to the processes that read them (`dsv41-stack args` shows which
process gets what); their names, defaults and meanings are the components' own declarations
(COMPONENT_ENVS), never restated here."""

from __future__ import annotations

import contextlib

from async_handoff import env as handoff_env
from ofl import env as ofl_env
from ofl.env import EnvVar
from remote_drafter import env as drafter_env
from remote_engram import env as engram_env

SETTINGS = [
    EnvVar("STACK_RUN_DIR", ".artifacts/stack",
           "Logs, pid files and results of this machine's roles."),
    EnvVar("STACK_MODEL", "", "The target checkpoint folder (the engine serves it; the drafter's "
           "identity is checked against it)."),
    EnvVar("STACK_VLLM_PYTHON", "python3", "The interpreter that has vLLM and the overlays."),
    EnvVar("STACK_ENGINE_LISTEN", "127.0.0.1:8000", "HOST:PORT of rank 0's OpenAI server.",
    kind="address"),
    EnvVar("STACK_TP", "1", "Tensor-parallel size of the engine (2 on the Sparks).",
    kind="int"),
    EnvVar("STACK_ENGINE_NODES", "1", "Hosts the engine spans, one vLLM process each (vLLM "
           "--nnodes, no Ray): 1 = every rank on this host; 2 = TP2 across the two Sparks, "
           "each started with `--role engine --rank N`: rank 0 serves the OpenAI API, rank 1 "
           "runs vLLM's headless worker. Must divide STACK_TP.",
    kind="int"),
    EnvVar("STACK_ENGINE_MASTER", "", "STACK_ENGINE_NODES > 1: HOST:PORT on rank 0's host where "
           "the ranks meet (vLLM --master-addr/--master-port: torch.distributed's store, opened "
           "by rank 0), reachable from every engine host; required then.",
    kind="address"),
    EnvVar("STACK_KV_BYTES", "1073741824", "KV cache budget per rank, bytes (--kv-cache-memory-bytes).",
    kind="int"),
    EnvVar("STACK_KV_BYTES_BASELINE", "", "The KV budget with the drafter inside the engine: what "
           "`rollback remote-drafter` restores (3.75 GiB in the reference); empty = keep.",
    kind="int"),
    EnvVar("STACK_MAX_MODEL_LEN", "2048", "Longest request, tokens (327,680 in the reference).",
    kind="int"),
    EnvVar("STACK_MAX_NUM_SEQS", "4", "Concurrent sequences (4 in the reference).",
    kind="int"),
    EnvVar("STACK_DTYPE", "float32", "Engine dtype (float32 on CPU; bfloat16 on the Sparks)."),
    EnvVar("STACK_ENFORCE_EAGER", "0", "1 = no compilation or graphs (the CPU miniature).",
    kind="flag"),
    EnvVar("STACK_ENGINE_ONE_PROCESS", "0", "1 = the model runner inside vLLM's engine-core "
           "process (vLLM's own choice on one GPU; on CPU vLLM starts a worker process), one "
           "interpreter fewer to start, with one OpenMP and one numba thread (the CPU miniature). Only with "
           "one rank (STACK_TP=1).",
    kind="flag"),
    EnvVar("STACK_NUM_SPEC_TOKENS", "5", "Draft tokens per step (batch-aware depth lowers it: "
           "REMOTE_DRAFTER_DEPTH); 0 = no speculation.",
    kind="int"),
    EnvVar("STACK_ENGRAM_SHARDS", "", "Offload host: folder of the Engram shards it serves."),
    EnvVar("STACK_ENGRAM_LISTEN", "", "Offload host: Engram server links, HOST:PORT per rank, "
           "comma-separated; empty = no Engram server."),
    EnvVar("STACK_DRAFTER", "", "Offload host: the drafter the worker serves (checkpoint folder, "
           "'ngram', 'module:Class'); empty = no worker."),
    EnvVar("STACK_DRAFTER_TARGET", "", "Offload host: the target folder the drafter was built "
           "for (its embedding, head and identity); empty = STACK_MODEL."),
    EnvVar("STACK_DRAFTER_LISTEN", "", "Offload host: HOST:PORT of the drafter worker.",
    kind="address"),
    EnvVar("STACK_DRAFTER_DEVICE", "cpu", "Offload host: the worker's device (cuda:0 on the 3090)."),
    EnvVar("STACK_DRAFTER_DTYPE", "float32", "Offload host: the weights' type on the worker's "
           "card(s): float32, bfloat16 or float16 (both kinds of worker; the identities do not "
           "change, `remote-drafter shadow` notes the difference).",
    choices=("float32", "bfloat16", "float16")),
    EnvVar("STACK_DRAFTER_WEIGHTS", "dense", "Offload host: dense = the drafter folder's own "
           "weights in STACK_DRAFTER_DTYPE; exl3 = STACK_DRAFTER is an EXL3 pack (`remote-drafter "
           "exl3 convert`) whose linears run through exllamav3's kernels (the one-card worker on "
           "CUDA; install `dsv41-stack[offload-host,exl3]`). DeepSeek-V4.1-Flash's drafter needs ~30 GiB in bf16 and "
           "~12 GiB at 4 bits (findings/dsv41-drafter.md, exl3-drafter.md): exl3 is what fits a "
           "24 GB card. The worker serves a pack only once `remote-drafter exl3 gate` recorded a "
           "pass for its weights (<pack>/exl3-gate.json); the stack never passes --ungated.",
    choices=("dense", "exl3")),
    EnvVar("STACK_DRAFTER_TP2", "0", "Offload host: 1 = the worker is drafter-tp2's two-card "
           "worker on STACK_DRAFTER_DEVICES, supervised (`drafter-tp2 supervise -- worker ...`; "
           "DeepSeek's drafter split by experts, dense or an EXL3 pack; a DSpark drafter "
           "tensor-parallel, dense), same listener, drafter and target as the one-card worker; "
           "0 = the one-card worker on STACK_DRAFTER_DEVICE. Rollback: "
           "`dsv41-stack rollback tp2-worker`, at the worker's restart.",
    kind="flag"),
    EnvVar("STACK_DRAFTER_DEVICES", "cuda:0,cuda:1", "Offload host, STACK_DRAFTER_TP2=1: the "
           "pair's two distinct devices, rank 0's first (cpu:0,cpu:1 runs it on CPU, gloo)."),
    EnvVar("STACK_ENGINE_HOSTS", "", "Offload host: every address the engine hosts connect from "
           "(each Spark's IP on its link, and toward the drafter worker if that differs), or "
           "their networks (10.0.0.0/30), comma-separated. The Engram server and the drafter "
           "worker then admit only these and this host's own listen addresses (where status "
           "reads them from): their OFL_ALLOW. Empty = OFL_ALLOW as the env file sets it "
           "(default: any peer; preflight FAILs an empty allow-list when the servers listen "
           "where other hosts reach them)."),
    EnvVar("STACK_INJECT_DELAY_MS", "0", "Miniature only: delay added to every Engram read and "
           "drafter round, a slow link on one machine.",
    kind="int"),
]
BY_NAME = {s.name: s for s in SETTINGS}
# The components whose variables the engines read (the overlays, the drafter's client, the
# async proxy, their links), each module declaring them in ALL.
COMPONENT_ENVS = (ofl_env, engram_env, drafter_env, handoff_env)
# What reaches the engines: every variable of COMPONENT_ENVS (tests hold the prefixes to them)
ENGINE_PREFIXES = ("ENGRAM_", "REMOTE_DRAFTER_", "VLLM_DSPARK_", "ASYNC_HANDOFF_", "OFL_")
# DRAFTER_TP2_*: the two-card worker's own variables (drafter-tp2 env), for the offload host
COMPONENT_PREFIXES = (*ENGINE_PREFIXES, "DRAFTER_TP2_")
# Checked on the offload host only, where drafter-tp2 is installed (`drafter-tp2 env`): the
# same env file may be read on an engine host, which lacks it.
UNCHECKED_PREFIXES = ("DRAFTER_TP2_",)


REDACTED = "REDACTED"  # what `args` shows for a secret's value (too short to pass as a key)


def component_envs() -> list:
    """COMPONENT_ENVS, and drafter-tp2's env module where it is installed (the offload host)."""
    modules = list(COMPONENT_ENVS)
    with contextlib.suppress(ImportError):
        from drafter_tp2 import env as tp2_env
        modules.append(tp2_env)
    return modules


def declared() -> dict[str, EnvVar]:
    """The STACK_ settings and every variable component_envs() declare, by name; read from
    the modules at each call, so a variable a component adds is known here as declared there."""
    return {**{v.name: v for module in component_envs() for v in module.ALL}, **BY_NAME}


def is_secret(name: str) -> bool:
    """A variable whose value is never printed or written where others can read it (OFL_AUTH_KEY)."""
    var = declared().get(name)
    return var is not None and var.secret


def shown(name: str, value: str) -> str:
    """A variable's value as the launcher may print it."""
    return REDACTED if is_secret(name) and value else value
