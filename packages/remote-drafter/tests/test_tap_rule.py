"""The vLLM overlay asks the target for the hidden states that carry the drafter's taps by
the rule vLLM 0.33 itself applies to DSpark drafters (read from the wheel's source, run on
made-up configs): DeepSeek-V4.1's ids as given, everyone else's shifted by one."""

import ast
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from remote_drafter.vllm.hooks import aux_layer_ids

RULE_FILE = "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"
RULE = "get_eagle3_aux_layers_from_config"


def vllm_rule():
    wheels = sorted((Path(__file__).resolve().parents[3] / ".artifacts/wheels").glob("vllm-0.33.0-*.whl"))
    if not wheels:
        pytest.skip("no vLLM 0.33.0 wheel in .artifacts/wheels: tools/vllm-cpu-env.sh downloads "
                    "it, and the vLLM tier of tools/test runs this test after it")
    with zipfile.ZipFile(wheels[0]) as wheel:
        tree = ast.parse(wheel.read(RULE_FILE).decode())
    [function] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == RULE]
    namespace = {"SpeculativeConfig": object}  # the annotation; the body reads attributes only
    exec(compile(ast.Module([function], []), RULE_FILE, "exec"), namespace)
    return namespace[RULE]


@pytest.mark.vllm  # the vLLM tier, after tools/vllm-cpu-env.sh has downloaded the wheel
@pytest.mark.parametrize("model_type", ["deepseek_v41", "deepseek_v4", "llama"])
@pytest.mark.parametrize("taps", [(1, 9, 17), (0, 5), (39,)])
def test_taps_map_to_the_hidden_states_vllm_would_capture_for_a_dspark_drafter(model_type, taps):
    hf_config = SimpleNamespace(model_type=model_type, dspark_target_layer_ids=list(taps))
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    assert aux_layer_ids(taps, model_type) == vllm_rule()(spec)


def test_v41_taps_are_used_as_given_and_the_others_shift():
    assert aux_layer_ids((17, 1, 9), "deepseek_v41") == (1, 9, 17)
    assert aux_layer_ids((17, 1, 9), "llama") == (2, 10, 18)
