"""The committed checkpoint: its identity, its size, that it loads as the remote-drafter
worker loads it, and that its recorded validation acceptance reproduces on the CPU.

The last two need the miniature's folder (.artifacts/smollm2-135m), which
tools/vllm-cpu-env.sh makes; tools/test runs them in the vLLM CPU tier (-m vllm)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from native_drafter.evaluate import exact_rounds
from remote_drafter.models.dspark import CONFIG_FILE, WEIGHTS_FILE, DSparkDrafter
from remote_drafter.models.llama import LlamaLM
from remote_drafter.models.ngram import NgramDrafter

ROOT = Path(__file__).resolve().parents[3]
CKPT = ROOT / "packages" / "native-drafter" / "checkpoints" / "smollm2-135m-dspark"
TARGET = ROOT / ".artifacts" / "smollm2-135m"
NEEDS_TARGET = pytest.mark.skipif(
    not (TARGET / "model.safetensors").exists(),
    reason="needs the miniature's folder from tools/vllm-cpu-env.sh (tools/test: vLLM CPU tier)")


def test_checkpoint_files_match_their_recorded_digests():
    training = json.loads((CKPT / "training.json").read_text())
    identity = json.loads((CKPT / "identity.json").read_text())
    data = (CKPT / WEIGHTS_FILE).read_bytes()
    assert len(data) < 32 * 2**20, "the committed checkpoint must stay under 32 MiB"
    assert hashlib.sha256(data).hexdigest() == identity["safetensors_sha256"]
    meta = json.loads((CKPT / CONFIG_FILE).read_text())
    assert meta["target_digest"] == training["identity"]["target_digest"] == identity["manifest"]["target"]
    assert (meta["num_layers"], meta["markov_rank"], meta["block_size"], meta["window"]) == (3, 32, 5, 128)
    assert training["gate_before_passed"] is True
    assert training["corpus_digest"] == training["token_files"]["corpus_digest"]


@pytest.mark.vllm
@NEEDS_TARGET
def test_checkpoint_loads_as_the_worker_loads_it():
    drafter = DSparkDrafter.load(str(CKPT), str(TARGET))
    identity = json.loads((CKPT / "identity.json").read_text())
    assert drafter.manifest().to_json() == identity["manifest"]


@pytest.fixture(scope="module")
def target():
    return LlamaLM.load(str(TARGET))


@pytest.mark.vllm
@NEEDS_TARGET
def test_recorded_validation_acceptance_reproduces_on_cpu(target):
    """Exact E_1..E_5 (T = 0) at round starts of the GPU evaluation, recomputed here in
    float32: the same chains, up to near-ties between the CPU and the GPU (ARCHITECTURE.md
    § Exactness)."""
    rounds = json.loads((CKPT / "reproduce.json").read_text())["rounds"]
    prefixes = [np.asarray(r["prefix"], np.int64) for r in rounds]
    tokens = np.concatenate(prefixes)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in prefixes])])
    starts = [(i, r["class"], r["t"]) for i, r in enumerate(rounds)]
    drafter = DSparkDrafter.load(str(CKPT), str(TARGET))
    c = drafter.config
    got = exact_rounds(target, {"trained": drafter.model,
                                "ngram": NgramDrafter(vocab_size=c.vocab_size, max_depth=c.block_size)},
                       tokens, offsets, starts, tuple(c.target_layers))
    recorded = np.array([r["E_trained"] for r in rounds])
    mine = np.array(got["trained"])
    assert np.mean(mine[:, -1]) > 1.0, "the trained drafter accepts more than one token per round"
    same = (mine == recorded).all(axis=1)
    assert same.sum() >= len(rounds) - 1, f"rounds differ: CPU {mine[:, -1]} vs GPU {recorded[:, -1]}"
    assert abs(mine[:, -1].mean() - recorded[:, -1].mean()) <= 0.5
    assert np.array_equal(np.array(got["ngram"]), np.array([r["E_ngram"] for r in rounds]))
