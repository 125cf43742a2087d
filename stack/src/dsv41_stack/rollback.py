"""The reference rollbacks (ARCHITECTURE.md § Bring-up and rollbacks) as env-file changes. Each writes a new env file;
nothing changes until the process that reads it restarts with it (a running process keeps
the variables it started with): the engine for async, remote-drafter and remote-engram, the
offload host's drafter worker for tp2-worker."""

from __future__ import annotations

import shlex
from pathlib import Path

from async_handoff import env as handoff_env
from remote_drafter import env as drafter_env
from remote_engram import env as engram_env

from .config import StackConfig
from .roles import tp2_devices
from .settings import is_secret

LEVERS = {
    "async": "synchronous remote rounds (VLLM_DSPARK_REMOTE_ASYNC unset)",
    "remote-drafter": "the drafter inside the engine (REMOTE_DRAFTER_DRAFTER), the remote "
                      "settings removed, the baseline KV budget restored (STACK_KV_BYTES_BASELINE; "
                      "unset: the budget kept)",
    "remote-engram": "the local shard reader (ENGRAM_REMOTE and ENGRAM_HOSTS unset, ENGRAM_SHARD_DIR kept)",
    "tp2-worker": "the known-good one-card worker (STACK_DRAFTER_TP2=0) on STACK_DRAFTER_DEVICE, "
                  "with the same drafter, target and listener, hence the same identities",
}
# Who restarts for a lever to take effect, and how ({out}: the written env file).
RESTART = {
    "engine": ("the engine", "dsv41-stack down --role engine --env ... && dsv41-stack up "
               "--role engine --env {out} (each engine host, its --rank)"),
    "tp2-worker": ("the offload host's drafter worker", "dsv41-stack down --role drafter-worker "
                   "--env ... && dsv41-stack up --role drafter-worker --env {out} (the Engram "
                   "server and the engines keep running: no drafts meanwhile, target-only "
                   "decoding; clients reconnect when the worker is ready)"),
}


def rollback(cfg: StackConfig, lever: str) -> StackConfig:
    if lever == "async":
        return cfg.with_values(**{handoff_env.VLLM_DSPARK_REMOTE_ASYNC.name: None})
    if lever == "remote-drafter":
        if not cfg["STACK_DRAFTER"]:
            raise ValueError("rollback remote-drafter needs STACK_DRAFTER: the drafter the "
                             "engine will run itself")
        if cfg["STACK_DRAFTER_WEIGHTS"] != "dense":
            raise ValueError(f"rollback remote-drafter: STACK_DRAFTER is an {cfg['STACK_DRAFTER_WEIGHTS']} "
                             "pack, which only the worker serves (on its card, through exllamav3); the "
                             "engine runs dense drafters: add an env file that sets STACK_DRAFTER to the "
                             "dense drafter and STACK_DRAFTER_WEIGHTS=dense, after these")
        # without a baseline the budget stays as it is (the miniature's: nothing to give back)
        return cfg.with_values(**{
            drafter_env.REMOTE_DRAFTER_ADDRESS.name: None,
            drafter_env.REMOTE_DRAFTER_STANDBYS.name: None,
            drafter_env.REMOTE_DRAFTER_CAPACITY_MODE.name: None,
            handoff_env.VLLM_DSPARK_REMOTE_ASYNC.name: None,
            drafter_env.REMOTE_DRAFTER_DRAFTER.name: cfg["STACK_DRAFTER"]},
            STACK_KV_BYTES=cfg["STACK_KV_BYTES_BASELINE"] or cfg.values.get("STACK_KV_BYTES"))
    if lever == "remote-engram":
        if not cfg[engram_env.ENGRAM_SHARD_DIR]:
            raise ValueError("rollback remote-engram needs ENGRAM_SHARD_DIR: the local shards "
                             "that will serve the rows")
        return cfg.with_values(**{engram_env.ENGRAM_REMOTE.name: None, engram_env.ENGRAM_HOSTS.name: None})
    if lever == "tp2-worker":
        if cfg["STACK_DRAFTER_TP2"] != "1":
            raise ValueError("rollback tp2-worker: STACK_DRAFTER_TP2 is not 1 in these env files; "
                             "the one-card worker already serves")
        # the one-card worker on the card it names, else on the pair's rank 0 card
        device = cfg.values.get("STACK_DRAFTER_DEVICE") or tp2_devices(cfg)[0]
        return cfg.with_values(STACK_DRAFTER_TP2="0", STACK_DRAFTER_DEVICE=device)
    raise ValueError(f"unknown lever {lever!r}: {', '.join(LEVERS)}")


def write_env(cfg: StackConfig, path: Path, header: str) -> None:
    """The env file; readable by its owner only when it holds a secret (the ofl key)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{k}={shlex.quote(v)}" for k, v in cfg.values.items()]  # as config.parse reads them
    if any(is_secret(k) and v for k, v in cfg.values.items()):
        path.touch(mode=0o600)
        path.chmod(0o600)  # before the key is in it
    path.write_text("\n".join(lines) + "\n")
