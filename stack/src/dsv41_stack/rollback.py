"""The reference rollbacks (DESIGN 4.4) as env-file changes. Each writes a new env file;
nothing changes until the engine restarts with it (a running engine keeps the variables it
started with)."""

from __future__ import annotations

from pathlib import Path

from .config import StackConfig

LEVERS = {
    "async": "synchronous remote rounds (VLLM_DSPARK_REMOTE_ASYNC unset)",
    "remote-drafter": "the drafter inside the engine (REMOTE_DRAFTER_DRAFTER), the remote "
                      "settings removed, the baseline KV budget restored",
    "remote-engram": "the local shard reader (ENGRAM_REMOTE unset, ENGRAM_SHARD_DIR kept)",
}


def rollback(cfg: StackConfig, lever: str) -> StackConfig:
    if lever == "async":
        return cfg.with_values(VLLM_DSPARK_REMOTE_ASYNC=None)
    if lever == "remote-drafter":
        if not cfg["STACK_DRAFTER"]:
            raise ValueError("rollback remote-drafter needs STACK_DRAFTER: the drafter the "
                             "engine will run itself")
        return cfg.with_values(
            REMOTE_DRAFTER_ADDRESS=None, REMOTE_DRAFTER_CAPACITY_MODE=None,
            VLLM_DSPARK_REMOTE_ASYNC=None, REMOTE_DRAFTER_DRAFTER=cfg["STACK_DRAFTER"],
            STACK_KV_BYTES=cfg["STACK_KV_BYTES_BASELINE"] or None)
    if lever == "remote-engram":
        if not cfg.values.get("ENGRAM_SHARD_DIR"):
            raise ValueError("rollback remote-engram needs ENGRAM_SHARD_DIR: the local shards "
                             "that will serve the rows")
        return cfg.with_values(ENGRAM_REMOTE=None)
    raise ValueError(f"unknown lever {lever!r}: {', '.join(LEVERS)}")


def write_env(cfg: StackConfig, path: Path, header: str) -> None:
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{k}={v}" for k, v in cfg.values.items()]
    path.write_text("\n".join(lines) + "\n")
