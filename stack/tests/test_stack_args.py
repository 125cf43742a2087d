"""`dsv41-stack args`: each role's environment and command line, against golden files (the
interpreter path is written as PYTHON). Regenerate with STACK_GOLDEN_UPDATE=1."""

import os
import re
import sys
from pathlib import Path

import pytest

from dsv41_stack.cli import main, template_path

GOLDEN = Path(__file__).with_name("golden")


def filled(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.env"
    text = template_path(name).read_text()
    path.write_text(re.sub(r"<([^<>]+)>", lambda m: "X-" + re.sub(r"\W+", "-", m.group(1)), text))
    return path


CASES = {
    "local-all": lambda t: ["--env", str(template_path("local"))],
    "production-offload-host": lambda t: ["--env", str(filled(t, "production-D")), "--role", "offload-host"],
    "production-async-engine": lambda t: ["--env", str(filled(t, "production-D")),
                                          "--env", str(filled(t, "production-async")), "--role", "engine"],
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
