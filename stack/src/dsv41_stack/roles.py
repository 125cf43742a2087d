"""The processes of the deployment, each as the exact command line and environment it gets
(`dsv41-stack args` prints them; the demo runs them). The offload host has the Engram
server and the drafter worker; each engine host has vLLM with the overlays, configured by
the component variables of the env file (the overlays read them; no flags of ours)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from longctx_bench.launch import vllm_command

from .config import StackConfig

SERVED_NAME = "dsv41"


@dataclass
class Role:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # what the env file gives it
    ready_line: str | None = None  # a stdout line that says it serves
    ready_url: str | None = None   # or a URL that answers 200 once it serves


def engram_server(cfg: StackConfig) -> Role | None:
    links = [x.strip() for x in cfg["STACK_ENGRAM_LISTEN"].split(",") if x.strip()]
    if not links:
        return None
    cmd = [sys.executable, "-m", "remote_engram.cli", "serve", "--shards",
           cfg["STACK_ENGRAM_SHARDS"], "--backend", cfg.values.get("ENGRAM_BACKEND", "verbs")]
    for link in links:
        cmd += ["--listen", link]
    if cfg.int("STACK_INJECT_DELAY_MS"):
        cmd += ["--inject-delay-ms", cfg["STACK_INJECT_DELAY_MS"]]
    return Role("engram-server", cmd, cfg.components("OFL_"), ready_line="remote-engram serve:")


def drafter_worker(cfg: StackConfig) -> Role | None:
    if not cfg["STACK_DRAFTER"]:
        return None
    cmd = [sys.executable, "-m", "remote_drafter.cli", "worker", "--drafter", cfg["STACK_DRAFTER"],
           "--target", cfg["STACK_DRAFTER_TARGET"] or cfg["STACK_MODEL"],
           "--listen", cfg["STACK_DRAFTER_LISTEN"],
           "--device", cfg["STACK_DRAFTER_DEVICE"],
           "--backend", cfg.values.get("REMOTE_DRAFTER_BACKEND", "tcp")]
    if cfg.int("STACK_INJECT_DELAY_MS"):
        cmd += ["--inject-delay-ms", cfg["STACK_INJECT_DELAY_MS"]]
    return Role("drafter-worker", cmd, cfg.components("OFL_"), ready_line="remote-drafter worker:")


def speculative_config(cfg: StackConfig) -> str | None:
    """The remote proposer when a drafter is configured (remote or local), else none."""
    k = cfg.int("STACK_NUM_SPEC_TOKENS")
    drafter = cfg.values.get("REMOTE_DRAFTER_ADDRESS") or cfg.values.get("REMOTE_DRAFTER_DRAFTER")
    if not k or not drafter:
        return None
    return json.dumps({"method": "custom_class", "model": "remote_drafter.vllm.RemoteProposer",
                       "num_speculative_tokens": k})


def engine(cfg: StackConfig) -> Role:
    host, _, port = cfg["STACK_ENGINE_LISTEN"].rpartition(":")
    cmd = vllm_command(cfg["STACK_VLLM_PYTHON"], cfg["STACK_MODEL"], int(port),
                       speculative_config(cfg), cfg.int("STACK_KV_BYTES"), SERVED_NAME,
                       cfg["STACK_DTYPE"], cfg.int("STACK_MAX_MODEL_LEN"),
                       eager=cfg["STACK_ENFORCE_EAGER"] == "1", host=host,
                       extra=["--tensor-parallel-size", cfg["STACK_TP"],
                              "--max-num-seqs", cfg["STACK_MAX_NUM_SEQS"]])
    return Role("engine", cmd, {"HF_HUB_OFFLINE": "1", **cfg.components()},
                ready_url=f"http://{host}:{port}/v1/models")


def roles(cfg: StackConfig, role: str | None = None) -> list[Role]:
    """This machine's roles: `offload-host`, `engine`, or both (None)."""
    host = [r for r in (engram_server(cfg), drafter_worker(cfg)) if r is not None]
    if role == "offload-host":
        return host
    if role == "engine":
        return [engine(cfg)]
    return host + [engine(cfg)]
