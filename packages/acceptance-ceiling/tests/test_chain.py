"""Closed forms, hand-computed chains, Monte Carlo agreement, the loop's exactness at T = 0,
and an end-to-end check on tiny torch models."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acceptance_ceiling.chain import exact, monte_carlo, oracle, reference_path
from acceptance_ceiling.cost import RoundCost, depth_table
from acceptance_ceiling.dists import adjust, alpha
from acceptance_ceiling.loop import plain_generate, speculative_generate
from acceptance_ceiling.pairs import MarkovPair


def const(p):
    p = np.asarray(p, dtype=np.float64)
    return lambda prefix: p


def test_alpha_closed_forms():
    p = np.array([0.2, 0.3, 0.5])
    assert alpha(p, p) == pytest.approx(1.0)
    assert alpha(np.array([1.0, 0, 0]), np.array([0, 0.5, 0.5])) == 0.0
    assert alpha(np.array([0.5, 0.5, 0]), np.array([0.25, 0.25, 0.5])) == pytest.approx(0.5)


def test_adjust_temperature_and_top_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert adjust(logits, 0.0).tolist() == [1, 0, 0, 0]
    assert adjust(logits, 1.0) == pytest.approx([0.5, 0.3, 0.15, 0.05])
    assert adjust(logits, 1.0, top_p=0.7) == pytest.approx([0.625, 0.375, 0, 0])


def test_identical_and_disjoint_chains():
    p = [0.1, 0.2, 0.7]
    for k in (1, 2, 4):
        assert exact(const(p), const(p), [], k).mean == pytest.approx(k)
        assert exact(const([1, 0, 0]), const([0, 0.5, 0.5]), [], k).mean == 0.0


def test_hand_computed_two_step_chain():
    # alpha = 0.5 at every prefix -> E_2 = a + a^2 = 0.75; reference-path form agrees
    t, d = const([0.5, 0.5, 0.0]), const([0.25, 0.25, 0.5])
    assert exact(t, d, [], 2).mean == pytest.approx(0.75)
    assert reference_path(np.array([0.5, 0.5]), 2).mean == pytest.approx(0.75)


def test_prefix_dependent_chain_by_hand():
    # target: after token 0 always 0; after token 1 always 1. drafter proposes 0 or 1
    # evenly, then copies its last token. E_2 = P(x1=0 accepted)*(1+1) with p_t(0)=1 at start.
    def target(prefix):
        last = prefix[-1] if prefix else 0
        return np.array([1.0, 0.0]) if last == 0 else np.array([0.0, 1.0])

    def drafter(prefix):
        if not prefix:
            return np.array([0.5, 0.5])
        return np.array([1.0, 0.0]) if prefix[-1] == 0 else np.array([0.0, 1.0])

    # depth 1: min(1, .5) on token 0 = 0.5; depth 2 after 0: min(1, 1) = 1 -> 0.5 * (1 + 1)
    assert exact(target, drafter, [], 2).mean == pytest.approx(1.0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 3), temp=st.sampled_from([0.5, 1.0, 2.0]))
def test_monte_carlo_interval_holds_the_exact_value(seed, k, temp):
    pair = MarkovPair(vocab=5, noise=1.0, seed=seed, temperature=temp)
    prefix = [1, 3]
    ex = exact(pair.target, pair.drafter, prefix, k).mean
    mc = monte_carlo(pair.target, pair.drafter, prefix, k, 3000, np.random.default_rng(seed))
    # 99.9% band (the test runs many examples): widen the 95% half-width by 3.29 / 1.96
    half = (mc.high - mc.mean) * 3.29 / 1.96
    assert abs(mc.mean - ex) <= half + 1e-9


def test_oracle_ceiling():
    pair = MarkovPair(vocab=6, seed=3, temperature=0.0)
    assert oracle(pair.target, [2, 4], 4).mean == 4.0  # greedy oracle: every draft accepted
    t = const([0.6, 0.4])
    assert oracle(t, [], 3).mean == pytest.approx(0.6 + 0.36 + 0.216)


def test_loop_equals_greedy_at_temperature_zero():
    pair = MarkovPair(vocab=10, noise=3.0, seed=4, temperature=0.0)
    rng = np.random.default_rng(0)
    rounds = []
    for prompt in ([1, 2], [5, 5, 0], [9, 3], [0, 7, 7]):
        want = plain_generate(pair.target, prompt, 60, rng)
        got = speculative_generate(pair.target, pair.drafter, prompt, 4, 60, rng)
        assert got.tokens == want
        rounds += got.accepted
    assert min(rounds) < 4 and max(rounds) > 0  # rejections and rollbacks happened


def test_loop_samples_follow_the_target_distribution():
    # one position, tiny vocabulary: the first emitted token ~ p_t whatever the drafter
    t, d = np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.1, 0.8])
    rng = np.random.default_rng(1)
    firsts = [speculative_generate(const(t), const(d), [0], 2, 1, rng).tokens[0]
              for _ in range(6000)]
    freq = np.bincount(firsts, minlength=3) / len(firsts)
    assert np.abs(freq - t).max() < 0.025


def test_depth_table_prefers_depth_when_it_pays():
    cost = RoundCost(verify_base_ms=10, verify_per_row_ms=1.0, draft_base_ms=1,
                     draft_per_token_ms=0.5)
    table = depth_table(cost, {1: 0.8, 3: 2.0, 5: 2.4}, [1, 64])
    assert table["batches"][1]["k"] in (3, 5) and table["batches"][1]["speedup"] > 1.5
    assert table["batches"][64]["k"] in (0, 1)  # rows cost most at large batch


def test_end_to_end_on_tiny_torch_models():
    torch = pytest.importorskip("torch", reason="the torch-free venv has no torch; the main "
                                "venv runs this")
    from acceptance_ceiling.pairs import torch_dist

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):  # a causal LM over the last two tokens
        def __init__(self, vocab=8):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 16)
            self.out = torch.nn.Linear(32, vocab)

        def forward(self, ids):
            pad = torch.nn.functional.pad(ids, (1, 0))
            h = torch.cat([self.emb(pad[:, :-1]), self.emb(pad[:, 1:])], dim=-1)
            return self.out(h) * 3

    target = Tiny()
    drafter = Tiny()
    drafter.load_state_dict(target.state_dict())
    with torch.no_grad():
        drafter.out.weight.add_(torch.randn_like(drafter.out.weight) * 0.3)
    t, d = torch_dist(target, 1.0), torch_dist(drafter, 1.0)
    rng = np.random.default_rng(2)
    accepted, expected = [], []
    for prompt in ([1, 2], [3], [7, 0, 4]):
        res = speculative_generate(t, d, prompt, 2, 120, rng)
        accepted += res.accepted
        expected += [exact(t, d, pre, 2).mean for pre in res.round_starts]
    diff = np.subtract(accepted, expected)
    half = 3.29 * diff.std(ddof=1) / np.sqrt(len(diff))
    assert abs(diff.mean()) <= half  # measured agrees with the exact expectation
