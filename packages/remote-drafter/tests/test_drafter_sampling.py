"""T > 0: with the DSpark rule, speculative samples follow the target's distribution,
whether the verifier uses the drafter's probabilities or treats drafts as one-hot. A
chi-square test over every 3-token continuation of a 6-token vocabulary, with a
negative control (a verifier that accepts everything) that the same test must reject."""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from scipy.stats import chisquare  # noqa: E402

import remote_drafter.decode_loop as decode_loop  # noqa: E402
from remote_drafter.decode_loop import speculative_decode  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.transport import LocalTransport  # noqa: E402
from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter  # noqa: E402
from remote_drafter.models.llama import LlamaConfig, random_llama  # noqa: E402
from remote_drafter.worker.service import DraftService, ServiceConfig  # noqa: E402

VOCAB, T, N, PROMPT = 6, 0.8, 3000, [1, 4, 2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("sampling")
    target = random_llama(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        intermediate_size=64), seed=3, proj_std=0.3, embed_std=0.5)
    target.save(str(base / "target"))
    DSparkDrafter.create(str(base / "drafter"), str(base / "target"),
                         DSparkConfig(vocab_size=VOCAB, hidden_size=32, num_heads=2, num_kv_heads=1,
                                      window=8, mask_token_id=5), seed=4, init_std=0.3)
    return target, str(base / "drafter"), str(base / "target")


def exact_distribution(target) -> dict:
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=3):
            p = 1.0
            for i in range(3):
                logits, _ = target(torch.tensor(PROMPT + list(seq[:i])))
                p *= float(torch.softmax(logits[-1].double() / T, -1)[seq[i]])
            out[seq] = p
    return out


def p_value(samples: list[tuple], exact: dict) -> float:
    counts = {s: 0 for s in exact}
    for s in samples:
        counts[s] += 1
    big = [s for s in exact if exact[s] * N >= 5]
    small = [s for s in exact if exact[s] * N < 5]
    observed = [counts[s] for s in big] + [sum(counts[s] for s in small)]
    expected = [exact[s] * N for s in big] + [sum(exact[s] for s in small) * N]
    return chisquare(observed, np.array(expected) * sum(observed) / sum(expected)).pvalue


def sample_continuations(pair, use_probs: bool) -> tuple[list, float]:
    target, drafter, target_dir = pair
    service = DraftService(DSparkDrafter.load(drafter, target_dir), ServiceConfig(max_requests=N))
    client = DrafterClient(LocalTransport(service), f"{N}:2", want_probs=use_probs)
    prompts = {rid: PROMPT for rid in range(N)}
    result = speculative_decode(target, client, prompts, 3, temperature=T, k=2, seed=11,
                                use_probs=use_probs)
    return [tuple(result.tokens[rid]) for rid in range(N)], np.mean(result.accepted)


@pytest.fixture(scope="module")
def exact(pair):
    return exact_distribution(pair[0])


@pytest.mark.parametrize("use_probs", [True, False], ids=["draft-probs", "one-hot"])
def test_speculative_samples_follow_the_target(pair, exact, use_probs):
    samples, mean_accepted = sample_continuations(pair, use_probs)
    assert 0.1 < mean_accepted < 1.9  # drafts were both accepted and rejected
    assert p_value(samples, exact) > 1e-3


def test_the_test_rejects_a_wrong_verifier(pair, exact, monkeypatch):
    monkeypatch.setattr(decode_loop, "verify_chain",
                        lambda drafts, p_d, p_t, rng: (len(drafts), decode_loop.sample(p_t[len(drafts)], rng)))
    samples, _ = sample_continuations(pair, True)
    assert p_value(samples, exact) < 1e-3
