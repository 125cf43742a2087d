"""TP2 drafts equal one-card drafts at greedy, the protocol is the one-card protocol, and
rolling back to the one-card worker on the same checkpoint serves the same drafts."""

import numpy as np
import pytest

from drafter_tp2.parity import compare_single_rounds
from drafter_tp2.testing import PairProcess, tp2_env, worker_args
from ofl import Connection
from ofl.errors import RemoteError
from remote_drafter.decode_loop import plain_decode, speculative_decode
from remote_drafter.engine import protocol as P
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import Manifest, expectation
from remote_drafter.engine.transport import LocalTransport, RemoteTransport
from remote_drafter.models.llama import LlamaLM
from remote_drafter.models.registry import load_drafter
from remote_drafter.testing import HIDDEN_LAYERS, WorkerProcess
from remote_drafter.worker.service import DraftService
from remote_drafter.worker.shadow_parity import ShadowClient, synthetic_prompts

MAX_REQUESTS = 6


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    env = tp2_env(REMOTE_DRAFTER_LOCK_DIR=str(tmp_path_factory.mktemp("locks")))
    w = PairProcess(worker_args(models, "cpu:0,cpu:1", "--max-requests", str(MAX_REQUESTS),
                                "--max-requests-per-client", str(MAX_REQUESTS)), env)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def target(models):
    return LlamaLM.load(models["target"])


def client_for(models, address, depth="8:5"):
    return DrafterClient(RemoteTransport(address, "tcp", expectation(models["target"], None),
                                         retry_s=0.05), depth, deadline_s=5.0)


def test_single_rounds_equal_the_one_card_drafter(models, pair):
    """150 rounds of one request each, random histories: the TP2 worker's drafts against
    the one-card drafter's (the same code path a one-card worker runs). A difference is
    only allowed where the one-card drafter's top two are a near tie (its probability gap
    is reported); none was seen on this set (findings/drafter-tp2.md)."""
    one = load_drafter(models["dspark"], models["target"])
    client = client_for(models, pair.address)
    result = compare_single_rounds(client, one, 150, 40, seed=7)
    same, differences = result["identical"], result["difference_top2_gaps"]
    print(f"TP2 vs one-card single rounds: {same}/150 identical, near-tie gaps {differences}")
    assert same + len(differences) == 150
    assert all(gap < 1e-4 for gap in differences), f"differences away from near-ties: {differences}"
    assert same >= 147, f"only {same}/150 rounds identical (gaps {differences})"


def test_batched_decoding_matches_the_one_card_service_round_by_round(models, pair, target):
    """Batched rounds (opens, continues with hidden rows, releases) through a ShadowClient:
    the TP2 worker drives decoding, the one-card DraftService sees the same rounds; and the
    output is the target's greedy output (it never depends on the drafter)."""
    remote = client_for(models, pair.address)
    local = DrafterClient(LocalTransport(DraftService(load_drafter(models["dspark"], models["target"]))), "8:5")
    shadow = ShadowClient(remote, local)
    prompts = synthetic_prompts(4, target.config.vocab_size, length=12, seed=3)
    result = speculative_decode(target, shadow, prompts, 24, hidden_layers=HIDDEN_LAYERS)
    remote.propose()  # the releases go out
    p = shadow.parity
    print(f"TP2 vs one-card batched rounds: {p.identical}/{p.compared} identical")
    assert p.compared >= 20 and p.remote_missing == 0
    assert p.identical == p.compared, p.first_difference
    assert result.tokens == {rid: plain_decode(target, pr, 24) for rid, pr in prompts.items()}


def test_the_handshake_differs_from_the_one_card_worker_only_by_topology(models, pair):
    one = WorkerProcess(models["dspark"], models["target"], "tcp", 0, "--max-requests", str(MAX_REQUESTS),
                        "--max-requests-per-client", str(MAX_REQUESTS))
    try:
        described = []
        for address in (pair.address, one.address):
            with Connection(address, backend="tcp", identity="tp2-test") as conn:
                described.append(conn.peer_metadata["remote_drafter"])
        tp2, single = described
        topology = tp2["drafter"].pop("topology")
        assert topology["tp"] == 2 and topology["devices"] == ["cpu:0", "cpu:1"]
        assert topology["peer"] == "cpu, no peer link"
        assert "topology" not in single["drafter"]
        assert tp2 == single  # identities, limits, protocol, sizes: all the same
    finally:
        one.stop()


def test_rollback_to_the_one_card_worker_serves_the_same_drafts(models, pair, target):
    """The rollback procedure (README): the one-card worker on the same checkpoint has the
    same identities, and a client sees the same drafts from it, round by round."""
    one = WorkerProcess(models["dspark"], models["target"])
    try:
        tp2, single = client_for(models, pair.address), client_for(models, one.address)
        assert tp2.transport.info(2).manifest == single.transport.info(2).manifest
        shadow = ShadowClient(tp2, single)
        prompts = synthetic_prompts(3, target.config.vocab_size, length=10, seed=11)
        speculative_decode(target, shadow, prompts, 16, hidden_layers=HIDDEN_LAYERS)
        tp2.propose()  # the releases go out
        assert shadow.parity.compared >= 10 and shadow.parity.identical == shadow.parity.compared
    finally:
        one.stop()


def test_release_reopen_capacity_and_stats_as_on_one_card(models, pair):
    client = client_for(models, pair.address)
    rng = np.random.default_rng(1)
    feature = 3 * 64
    for rid in range(MAX_REQUESTS + 1):
        client.add_request(100 + rid, rng.integers(0, 90, 6), rng.standard_normal((5, feature)))
    drafts = client.propose()
    assert len(drafts) == MAX_REQUESTS  # the last open got the worker's capacity reply
    counters = client.counters()
    assert counters["capacity_refusals"] == 1, counters
    for rid in range(MAX_REQUESTS + 1):
        client.release(100 + rid)
    client.add_request(100, rng.integers(0, 90, 6), rng.standard_normal((5, feature)))
    assert 100 in client.propose()  # the releases went out; a reused id re-opens
    client.release(100)
    client.propose()
    with Connection(pair.address, backend="tcp", identity="tp2-test") as conn:
        fingerprint = Manifest.from_json(conn.peer_metadata["remote_drafter"]["manifest"]).fingerprint
        stats = P.parse_stats_reply(conn.request(P.encode_request([], fingerprint, kind=P.KIND_STATS)))
        with pytest.raises(RemoteError):
            conn.request(b"garbage that is no drafter request")
    assert stats["capacity_refusals"] >= 1 and stats["releases"] >= MAX_REQUESTS
    assert stats["open_requests"] == 0
    client.add_request(101, rng.integers(0, 90, 6), rng.standard_normal((5, feature)))
    assert 101 in client.propose()  # still serving after the garbage


def test_uneven_shards_odd_vocabulary_and_untied_head(tmp_path, lock_dir):
    """3 kv heads (split 2 + 1, as SmolLM2's 9/3), an odd feed-forward width and vocabulary
    (the head's shards padded for the gather), an untied output head: still the one-card
    drafts."""
    from remote_drafter.models.dspark import DSparkConfig, DSparkDrafter
    from remote_drafter.models.llama import LlamaConfig, random_llama
    t = LlamaConfig(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
                     num_key_value_heads=3, intermediate_size=129, tie_word_embeddings=False)
    target, drafter = str(tmp_path / "target"), str(tmp_path / "dspark")
    random_llama(t, seed=2).save(target)
    DSparkDrafter.create(drafter, target, DSparkConfig(
        vocab_size=97, hidden_size=48, num_heads=6, num_kv_heads=3, intermediate_size=129,
        window=16, target_layers=[0, 1], target_hidden_size=48, mask_token_id=96), init_std=0.3)
    models = {"dspark": drafter, "target": target}
    w = PairProcess(worker_args(models), tp2_env())
    try:
        one = load_drafter(drafter, target)
        client = client_for(models, w.address)
        assert compare_single_rounds(client, one, 40, 30, seed=5)["identical"] == 40
    finally:
        w.stop()


def test_the_pair_holds_the_one_card_workers_quotas_and_listener():
    """Same capacity and listener flags as `remote-drafter worker` (one definition): half
    the slots per client by default, loopback unless told, and what the launcher passes
    both ranks keeps an explicit quota and --insecure."""
    import argparse

    from drafter_tp2.cli import add_worker_args, rank_config, worker_argv
    p = argparse.ArgumentParser()
    add_worker_args(p)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--master", default="127.0.0.1:1")
    base = ["--drafter", "d", "--target", "t", "--devices", "cpu:0,cpu:1", "--max-requests", "8"]
    assert rank_config(p.parse_args(base)).service.max_requests_per_client == 4
    given = p.parse_args([*base, "--max-requests-per-client", "8"])
    assert rank_config(given).service.max_requests_per_client == 8
    assert rank_config(p.parse_args(worker_argv(given))).service.max_requests_per_client == 8
    default = rank_config(p.parse_args(base))
    assert (default.listen, default.insecure) == ("127.0.0.1:7490", None)  # None: OFL_INSECURE
    insecure = p.parse_args([*base, "--listen", "0.0.0.0:7490", "--insecure"])
    passed_on = rank_config(p.parse_args(worker_argv(insecure)))
    assert (passed_on.listen, passed_on.insecure) == ("0.0.0.0:7490", True)
