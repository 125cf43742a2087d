"""tools/check-vllm-hooks.py fails when a hook the overlays patch changes (and passes on the
real source): a fake vLLM tree made from the installed release, one signature edited."""

import importlib.util
import shutil
from pathlib import Path

import pytest

for needed in ("torch", "remote_drafter"):  # the overlays' hook tables live in torch-side modules
    pytest.importorskip(needed, reason="reads both overlays' hook tables: the dev venv's unit "
                        "tier runs it (the torch-free venv has neither torch nor the overlays)")

ROOT = Path(__file__).resolve().parents[3]
FILES = ("vllm/v1/worker/gpu_model_runner.py", "vllm/models/deepseek_v41/common/engram.py")


def load_checker():
    spec = importlib.util.spec_from_file_location("check_hooks", ROOT / "tools" / "check-vllm-hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BODY = {"propose_draft_token_ids": 'return "custom_class"',
        "load_model": "self._setup_eagle3_aux_hidden_state_outputs()"}


def fake_release(tmp_path: Path, edit=None) -> str:
    """The hook files, written from the checker's own tables of what they must hold."""
    checker = load_checker()
    for name in FILES:
        helpers, lines = [], []
        for cls, methods in checker.HOOKS[name].items():
            lines.append(f"class {cls}:")
            for method, params in methods.items():
                if params[0] != "self":  # a loader wrapped in staticmethod
                    helpers.append(f"def _{method}({', '.join(params)}): pass")
                    lines.append(f"    {method} = staticmethod(_{method})")
                else:
                    lines.append(f"    def {method}({', '.join(params)}): {BODY.get(method, 'pass')}")
            if cls == "GPUModelRunner":
                lines.append(f"    def load_model(self): {BODY['load_model']}")
        text = "\n".join(helpers + lines)
        if edit:
            text = edit(name, text)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    return str(tmp_path / "vllm")


def test_the_checker_passes_the_hooks_as_written(tmp_path):
    assert load_checker().main([fake_release(tmp_path)]) == 0


def test_the_checker_fails_a_changed_signature(tmp_path, capsys):
    def rename(name, text):
        return text.replace("def prepare_embeddings(self, hash_ids)", "def prepare_embeddings(self, ids)")
    assert load_checker().main([fake_release(tmp_path, rename)]) == 1
    assert "Engram.prepare_embeddings" in capsys.readouterr().out


def test_the_checker_fails_a_moved_call(tmp_path):
    def drop(name, text):
        return text.replace("self._setup_eagle3_aux_hidden_state_outputs()", "pass")
    assert load_checker().main([fake_release(tmp_path, drop)]) == 1


def test_a_missing_file_is_an_error_not_a_pass(tmp_path):
    release = fake_release(tmp_path)
    shutil.rmtree(Path(release) / "models")
    with pytest.raises(FileNotFoundError):
        load_checker().main([release])
