"""DeepSeek's own drafter on a pair (`--drafter dsv41:DIR`, kinds/dsv41.py): two CPU ranks
(gloo, float32), each reading only its half of every layer's routed experts, draft what the
one-card drafter drafts on the same checkpoint (greedy and seeded draws, V4.1 and V4), with
the one-card identity and one all-reduce per MoE layer; a rank missing its experts, or
holding other weights, is refused on both ranks by tensor name before anyone connects."""

import json
import os
import shutil
import signal
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from drafter_tp2.kinds.dsv41 import PairDrafter
from drafter_tp2.launcher import free_master
from drafter_tp2.parity import compare_single_rounds
from drafter_tp2.testing import PairProcess, RankPair, tp2_env
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.transport import RemoteTransport, worker_stats
from remote_drafter.models.dsv41 import checkpoint, tiny
from remote_drafter.models.dsv41.config import routed_expert
from remote_drafter.models.dsv41.drafter import Dsv41Drafter


@pytest.fixture(scope="module", params=tiny.VARIANT_NAMES)
def folder(tmp_path_factory, request):
    out = str(tmp_path_factory.mktemp(f"dsv41-{request.param}"))
    tiny.write_tiny(out, variant=request.param)
    return out


def args_for(folder, *extra):
    return ["--drafter", f"dsv41:{folder}", "--target", folder, "--devices", "cpu:0,cpu:1",
            "--listen", "127.0.0.1:0", *extra]


@pytest.fixture(scope="module")
def pair(folder, tmp_path_factory):
    env = tp2_env(REMOTE_DRAFTER_LOCK_DIR=str(tmp_path_factory.mktemp("locks")))
    w = PairProcess(args_for(folder), env)
    yield w
    w.stop()


def client_for(folder, address):
    return DrafterClient(RemoteTransport(address, "tcp", expectation(folder, None), retry_s=0.05),
                         "5:5", deadline_s=10.0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_pair_drafts_what_one_card_drafts(folder, pair, temperature):
    """Single rounds of random histories: greedy and seeded draws equal the one-card
    drafter's; where one differs, its top two were a near tie (gap printed)."""
    one = Dsv41Drafter.load(folder)
    result = compare_single_rounds(client_for(folder, pair.address), one, 40, 60, seed=3,
                                   temperature=temperature)
    same, gaps = result["identical"], result["difference_top2_gaps"]
    print(f"dsv41 pair vs one card at T={temperature}: {same}/40 identical, near-tie gaps {gaps}")
    assert all(g < 1e-4 for g in gaps), gaps
    assert same >= 39, (same, gaps)


def test_the_pair_has_the_one_card_identity_and_one_all_reduce_per_moe_layer(folder, pair):
    one = Dsv41Drafter.load(folder)
    client = client_for(folder, pair.address)
    info = client.transport.info(10)
    assert info.fingerprint == one.manifest().fingerprint  # both ranks' digests, combined
    compare_single_rounds(client, one, 3, 20, seed=9)
    topology = worker_stats(pair.address)["drafter"]["topology"]  # live: the rounds so far
    c = one.config
    half = (c.n_routed_experts + 1) // 2
    assert topology["experts"] == {"rank 0": [0, half], "rank 1": [half, c.n_routed_experts]}
    rounds, calls = topology["rounds_run"], topology["collectives"]
    assert rounds >= 3
    assert calls["MoE all-reduce"]["calls"] == c.n_mtp_layers * rounds
    assert calls["embedding all-reduce"]["calls"] == calls["head all-gather"]["calls"] == rounds
    print(f"collectives over {rounds} rounds: {calls}")


def rewrite(folder: str, edit) -> None:
    """edit({name: tensor}) applied to every shard, the index in step."""
    index_path = os.path.join(folder, checkpoint.INDEX_FILE)
    with open(index_path) as f:
        index = json.load(f)
    kept = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(folder, shard))
        edit(tensors)
        save_file(tensors, os.path.join(folder, shard), metadata={"format": "pt"})
        kept.update({n: shard for n in tensors})
    index["weight_map"] = kept
    with open(index_path, "w") as f:
        json.dump(index, f)


def refused(folder, other, lock_dir) -> tuple[str, str]:
    """Rank 0 on `folder`, rank 1 on `other`: both must refuse; their stderr."""
    args, args1 = args_for(folder), args_for(other)
    args1[args1.index("--target") + 1] = folder
    pair = RankPair(args, free_master("127.0.0.1:0"), tp2_env(), args1=args1)
    try:
        (c0, e0), (c1, e1) = pair.wait(timeout=120)
    finally:
        pair.kill()
    assert (c0, c1) == (2, 2), (e0, e1)
    return e0, e1


def test_both_ranks_attend_with_the_kernels_defaults(monkeypatch):
    """The attention is replicated: a rank never times its own form (REMOTE_DRAFTER_ATTENTION
    notwithstanding), so the stream entering each MoE stays the same bits on both ranks."""
    monkeypatch.setenv("REMOTE_DRAFTER_ATTENTION", "auto")
    numerics = SimpleNamespace(attend_chosen=None)
    PairDrafter._choose_attention(SimpleNamespace(model=SimpleNamespace(numerics=numerics)))
    assert numerics.attend_chosen == {}  # chosen: the defaults, so no timing follows


def test_a_rank_without_its_experts_is_refused_on_both_ranks_by_name(folder, tmp_path, lock_dir):
    other = shutil.copytree(folder, tmp_path / "no-rank-1-experts")
    rewrite(str(other), lambda t: [t.pop(n) for n in list(t) if routed_expert(n) in (2, 3)])
    for text in refused(folder, str(other), lock_dir):
        assert "refusing to serve: rank 1 cannot load its part" in text, text
        assert "mtp.0.ffn.experts.2.w1.weight: missing" in text, text


def test_ranks_holding_other_weights_are_refused_on_both_ranks_by_name(folder, tmp_path, lock_dir):
    other = shutil.copytree(folder, tmp_path / "other-norm")
    name = "mtp.1.attn_norm.weight"

    def change(t):
        if name in t:
            t[name] = t[name] * 2
    rewrite(str(other), change)
    for text in refused(folder, str(other), lock_dir):
        assert (f"refusing to serve: different weights: rank 0 (dsv41:{folder}) and rank 1 "
                f"(dsv41:{other}) hold different {name}\n") in text, text


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_rank_1_killed_or_hung_mid_serve_stops_the_pair_and_clients_get_no_drafts(folder, lock_dir, fault):
    """After three answered rounds rank 1 is killed (or stopped: a hang, found by the pair's
    deadline): the next round gets no drafts (the engine decodes target-only), and rank 0
    stops serving, saying why."""
    import numpy as np
    pair = RankPair(args_for(folder), free_master("127.0.0.1:0"))
    try:
        client = client_for(folder, pair.ready())
        rng, answered = np.random.default_rng(0), []
        feature = Dsv41Drafter.load(folder).feature
        for rid in range(6):
            if len(answered) == 3:
                os.kill(pair.procs[1].pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            client.add_request(rid, rng.integers(0, 100, 12).astype(np.int32),
                               rng.standard_normal((11, feature)).astype(np.float32))
            drafts = client.propose().get(rid)
            if drafts is not None and len(drafts.tokens):
                answered.append(rid)
            client.release(rid)
        code0 = pair.procs[0].wait(timeout=30)
        err0 = pair.stderr(0)
    finally:
        pair.kill()
    assert answered == [0, 1, 2], answered  # drafts, then none: fail closed
    assert client.counters()["rounds_failed"] + client.counters()["entries_failed"] > 0
    assert code0 == 3 and "drafter-tp2 rank 0: stopped serving:" in err0, err0


def test_the_rank_shard_benchmark_runs_in_its_smoke_form(tmp_path):
    """benchmarks/dsv41_rank_gpu.py (the GPU tier's per-rank measurement) at the tiny width
    on the CPU: both ranks' shards hold their halves, each round has a floor."""
    import subprocess
    import sys
    out = tmp_path / "rank.json"
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "dsv41_rank_gpu.py")
    done = subprocess.run([sys.executable, script, "--smoke", "--rounds", "2", "--batches", "1,4",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["experts"] for r in ranks] == [[0, 2], [2, 4]]
    for r in ranks:
        assert [x["batch"] for x in r["rounds"]] == [1, 4] and all(x["floor_ms"] > 0 for x in r["rounds"])
        assert all(x["routed_expert_bytes"] > 0 for x in r["rounds"])
        for x in r["rounds"]:  # one all-reduce per MoE layer, the embedding's, the head's gather
            calls = {n: v["calls"] for n, v in x["collectives_per_round"].items()}
            assert calls == {"MoE all-reduce": 3, "embedding all-reduce": 1, "head all-gather": 1}, calls


def test_an_ungated_exl3_pack_is_refused_on_both_ranks_before_loading(folder, tmp_path, lock_dir):
    """A pack (exl3.json) without a passed fidelity gate: refused before anything loads, as
    the one-card worker refuses it (the pair has no --ungated)."""
    from remote_drafter.models import exl3
    pack = shutil.copytree(folder, tmp_path / "pack")
    exl3.write_pack(str(pack), {"kind": "dsv41", "bits": 4, "linears": []})
    pair = RankPair(args_for(str(pack)), free_master("127.0.0.1:0"), tp2_env())
    try:
        (c0, e0), (c1, e1) = pair.wait(timeout=120)
    finally:
        pair.kill()
    assert (c0, c1) == (2, 2), (e0, e1)
    for text in (e0, e1):
        assert "cannot load its part" in text and "has no fidelity gate record" in text, text
