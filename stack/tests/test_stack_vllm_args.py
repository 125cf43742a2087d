"""The two-host engine's command lines read by the vLLM they are for (the vLLM CPU tier:
LONGCTX_VLLM_PYTHON): vLLM's own serve parser takes both ranks' arguments and reads the
multi-node settings from them, rank 1's entry point is the `serve` CLI (which honours
--headless), and the line `up` waits for on rank 1 is the one vLLM logs."""

import json
import os
import subprocess

import pytest

from dsv41_stack.config import StackConfig
from dsv41_stack.roles import HEADLESS_READY, engine

PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]

# `vllm serve`'s own parser (the OpenAI module builds the same one: make_arg_parser, whose
# home moved between 0.32 and 0.33; the serve subcommand is where both versions keep it)
PARSE = """
import argparse, inspect, json, sys
import vllm, vllm.entrypoints.cli.serve as serve
from vllm.engine.arg_utils import AsyncEngineArgs
root = argparse.ArgumentParser()
parser = serve.ServeSubcommand().subparser_init(root.add_subparsers())
out = {"version": vllm.__version__, "serve_source": inspect.getsource(serve), "ranks": []}
for argv in json.loads(sys.argv[1]):
    args = parser.parse_args(argv)
    e = AsyncEngineArgs.from_cli_args(args)
    out["ranks"].append({"headless": args.headless, "nnodes": e.nnodes, "node_rank": e.node_rank,
                         "master_addr": e.master_addr, "master_port": e.master_port,
                         "tp": e.tensor_parallel_size, "model": e.model,
                         "kv": e.kv_cache_memory_bytes, "spec": e.speculative_config})
print(json.dumps(out))
"""


def test_vllm_reads_both_ranks_command_lines():
    cfg = StackConfig({"STACK_MODEL": "/models/dsv41", "STACK_VLLM_PYTHON": PYTHON, "STACK_TP": "2",
                       "STACK_ENGINE_NODES": "2", "STACK_ENGINE_MASTER": "10.0.0.1:29501",
                       "STACK_ENGINE_LISTEN": "0.0.0.0:8000", "REMOTE_DRAFTER_ADDRESS": "10.0.0.3:7490"})
    zero, one = engine(cfg, 0).command, engine(cfg, 1).command
    assert zero[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert one[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    got = subprocess.run([PYTHON, "-c", PARSE, json.dumps([zero[3:], one[4:]])], capture_output=True,
                         text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    parsed = json.loads(got.stdout.strip().splitlines()[-1])
    for rank, seen in enumerate(parsed["ranks"]):
        assert seen["headless"] is (rank == 1)
        assert (seen["nnodes"], seen["node_rank"], seen["tp"]) == (2, rank, 2), seen
        assert (seen["master_addr"], seen["master_port"]) == ("10.0.0.1", 29501), seen
        assert seen["model"] == "/models/dsv41" and seen["kv"] == cfg.int("STACK_KV_BYTES")
        assert seen["spec"]["model"] == "remote_drafter.vllm.RemoteProposer"
    assert f"Launching vLLM (v%s) {HEADLESS_READY}" in parsed["serve_source"]
