"""Unit tier: DeepSeek-V4.1's drafter as a Drafter (models/dsv41/drafter.py) on the tiny
random V4.1 checkpoint (models/dsv41/tiny.py), CPU, float32: batching, the device-resident
context, greedy and sampled drafts, the confidence cut-off, and a worker serving it exactly
at T = 0 for a tiny Llama target as wide as the drafter (its hidden rows are the taps);
DeepSeek-V4's (variant v4, the same code) where the variants differ: loading, the greedy
chain, the worker."""

import copy

import benchmark_scripts
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.decode_loop import plain_decode, speculative_decode  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.identity import expectation  # noqa: E402
from remote_drafter.engine.transport import RemoteTransport  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.dsv41 import tiny  # noqa: E402
from remote_drafter.models.dsv41.drafter import Dsv41Drafter, unpack_chain  # noqa: E402
from remote_drafter.models.dsv41.modules.moe import StackedExperts  # noqa: E402
from remote_drafter.models.llama import LlamaConfig, LlamaLM, random_llama  # noqa: E402
from remote_drafter.models.pick import Picker, chain_arrays  # noqa: E402
from remote_drafter.models.registry import load_drafter  # noqa: E402
from remote_drafter.testing import WorkerProcess  # noqa: E402

# Llama-style, as wide as the tiny V4.1 drafter, with as many layers as its taps need
TARGET = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=tiny.HIDDEN, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("dsv41")
    tiny.write_tiny(str(base / "dsv41"))
    tiny.write_tiny(str(base / "dsv4"), seed=1, variant="v4")
    random_llama(TARGET, seed=0).save(str(base / "target"))
    return {"dsv41": str(base / "dsv41"), "dsv4": str(base / "dsv4"), "target": str(base / "target")}


@pytest.fixture(scope="module")
def drafter(folders):
    return load_drafter("dsv41:" + folders["dsv41"], folders["target"])


@pytest.fixture(scope="module", params=["dsv41", "dsv4"])
def either(folders, request):
    """The V4.1 drafter, then the V4 one (kind dsv41 serves both)."""
    return load_drafter("dsv41:" + folders[request.param], folders["target"])


def history(d, n_tokens: int, seed: int, rows: int | None = None):
    """A history of n_tokens random tokens with the rows of all but the newest (or `rows`)."""
    rng = np.random.default_rng(seed)
    h = d.new_history()
    n_rows = n_tokens - 1 if rows is None else rows
    h.reset(rng.integers(0, d.vocab_size - 1, n_tokens).astype(np.int32),
            rng.standard_normal((n_rows, d.feature)).astype(np.float32))
    return h


def fresh(d: Dsv41Drafter, cutoff: float = 0.0) -> Dsv41Drafter:
    """The same model and identity, no device windows yet."""
    return Dsv41Drafter(d.model, d.manifest(), d.device, cutoff)


def assert_close(a, b):
    assert np.array_equal(a.tokens, b.tokens)
    for name in ("probs", "own_probs", "alt_probs", "confidence"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or np.allclose(x, y, atol=2e-5)), name


def test_it_loads_as_configured(either):
    drafter, c = either, either.config
    described = drafter.describe()
    assert described["kind"] == "dsv41" and described["hidden_layers"] == list(c.target_layer_ids)
    assert drafter.feature == len(c.target_layer_ids) * c.hidden_size == described["feature"]
    assert drafter.max_depth == c.block_size and drafter.window == c.sliding_window
    m = drafter.manifest()
    assert m.kind == "dsv41" and len({m.target, m.drafter, m.markov}) == 3
    assert described["confidence_head"] and described["confidence_cutoff"] == 0.0
    assert c.hc_head == (c.variant == "v4") and c.delayed_mhc == (c.variant == "v41")


def test_a_drafter_for_another_vocabulary_is_refused(folders, tmp_path):
    random_llama(LlamaConfig(vocab_size=96, hidden_size=tiny.HIDDEN), seed=1).save(str(tmp_path / "t"))
    with pytest.raises(ValueError, match="vocabulary of 1024"):
        load_drafter("dsv41:" + folders["dsv41"], str(tmp_path / "t"))


def test_batched_drafts_equal_one_by_one(drafter):
    """Short, window-long and longer histories, a history with fewer rows than the window,
    greedy and sampled, mixed depths: each request drafts what it drafts alone."""
    d, w = drafter, drafter.window
    requests = [DraftRequest(history(d, 3, 1), 5), DraftRequest(history(d, w + 1, 2), 3),
                DraftRequest(history(d, 2 * w + 7, 3), 5, 0.8, 11),
                DraftRequest(history(d, w + 40, 4, rows=w), 4, 1.3, 5)]
    together = fresh(d).draft(requests, True)
    for r, got in zip(requests, together):
        assert_close(got, fresh(d).draft([r], True)[0])


def test_incremental_context_equals_recomputing_it(drafter):
    """Rounds of 1..12 committed tokens, past the window (the ring wraps): the drafter that
    encodes only new rows drafts what a fresh one, encoding them all, drafts (checked every
    few rounds); and the rows on the device are every layer's rows recomputed from the
    history's taps."""
    d, rng = fresh(drafter), np.random.default_rng(7)
    h, rounds = history(d, 10, 7), 0
    while h.length < 2 * d.window + 10:
        k = int(rng.integers(1, 13))
        h.extend(rng.integers(0, d.vocab_size - 1, k).astype(np.int32),
                 rng.standard_normal((k, d.feature)).astype(np.float32))
        r, rounds = DraftRequest(h, 5, 0.9, 3), rounds + 1
        got = d.draft([r], True)[0]
        if rounds % 4 == 0:
            assert_close(got, fresh(d).draft([r], True)[0])
    ctx, kept = d._windows.lay_out([h], "cpu")
    assert kept.tolist() == [d.window]
    positions = torch.arange(h.length - 1 - d.window, h.length - 1)
    want = d.model.encode_rows(torch.tensor(h.rows), positions)
    assert torch.allclose(ctx[0], want, atol=1e-5)


def test_greedy_drafts_are_a_deterministic_markov_chain(either):
    """Draft i is the argmax of z_i plus the Markov bias of draft i-1 (draft 0: of the seed),
    the same every time; its probability is a point mass."""
    d, h = fresh(either), history(either, 30, 9)
    a, b = d.draft([DraftRequest(h, 5)], True)[0], d.draft([DraftRequest(h, 5)], True)[0]
    assert a.tokens.tobytes() == b.tokens.tobytes() and a.probs.tobytes() == b.probs.tobytes()
    assert np.array_equal(a.probs.argmax(-1), a.tokens) and np.all(a.probs.max(-1) == 1.0)
    m, n = d.model, d.window
    ctx = torch.zeros(1, n, d.config.n_mtp_layers * d.config.head_dim)
    ctx[0, n - 29:] = m.encode_rows(torch.tensor(h.rows), torch.arange(29))
    valid = torch.zeros(1, n, dtype=torch.bool)
    valid[0, n - 29:] = True
    seed = torch.tensor([int(h.tokens[-1])])
    hidden = m.block_hidden(ctx.view(1, n, d.config.n_mtp_layers, -1), valid, seed, torch.tensor([29]))
    z, previous = m.head(hidden), seed
    for i, token in enumerate(a.tokens):
        logits = m.markov.logits(z[:, i], m.markov.embed(previous))
        assert int(logits.argmax()) == token
        assert np.isclose(a.confidence[i], float(m.confidence(hidden[:, i], m.markov.embed(previous))),
                          atol=1e-6)
        previous = torch.tensor([int(token)])
    bias = m.markov.logits(torch.zeros(1, d.vocab_size), m.markov.embed(seed))
    assert bias.abs().max() > 0.1  # the head is not inert


@pytest.mark.parametrize("path", ["grouped GEMMs", "every expert on every row"])
def test_stacked_experts_draft_as_the_chosen_experts_do(folders, path):
    """What CUDA graphs capture (REMOTE_DRAFTER_CUDA_GRAPHS: the stacked experts, each row's
    chosen ones through grouped GEMMs, or every expert on every row weighted by the routing,
    zero where not chosen, where grouped GEMMs do not run) against the chosen-experts loop:
    the same block logits in float32 and the same greedy drafts; on the CPU the round stays
    eager."""
    chosen = load_drafter("dsv41:" + folders["dsv41"], folders["target"])
    every = load_drafter("dsv41:" + folders["dsv41"], folders["target"])
    assert every.model.stack_experts() is None  # torch's CPU build has grouped GEMMs
    for layer in every.model.layers:
        assert isinstance(layer.moe.experts, StackedExperts) and layer.moe.experts.grouped
        layer.moe.experts.grouped = path == "grouped GEMMs"
    assert every.model.stack_experts() == (None if path == "grouped GEMMs" else "grouped GEMMs switched off")
    names = [n for n, _ in every.model.named_tensors() if ".experts." in n]
    assert names and all(n.endswith(".stacked") for n in names)  # the per-expert tensors dropped
    assert sum(t.numel() for t in every.model.parameters()) == sum(t.numel() for t in chosen.model.parameters())
    for seed in range(3):
        requests = [DraftRequest(history(chosen, 20 + 7 * i, 10 * seed + i), chosen.max_depth) for i in range(3)]
        inputs = chosen._blank(3)
        inputs[0].normal_(generator=torch.Generator().manual_seed(seed))
        inputs[1][:] = torch.tensor([[10 * (seed + 1), 5, 40], [10 * (seed + 1), 9, 60], [10 * (seed + 1), 17, 80]])
        (h1, z1, *_), (h2, z2, *_) = chosen._block(*inputs), every._block(*inputs)
        assert float((h1 - h2).norm() / h1.norm()) < 1e-5 and float((z1 - z2).norm() / z1.norm()) < 1e-5
        assert torch.equal(z1.argmax(-1), z2.argmax(-1))
        a, b = chosen.draft(requests, want_probs=False), every.draft(requests, want_probs=False)
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert fresh(every).describe()["cuda_graphs"] == "off (eager rounds)"


def test_a_round_sends_its_small_arrays_in_one_copy(drafter, monkeypatch):
    """Every small array a round needs on the device (the new rows' positions and ring rows,
    the context's ring rows, rows kept, seeds, positions) goes in one copy, whatever the
    batch, also when one lineage's two snapshots split the batch in two parts (on a GPU each
    copy costs the host a fixed price; the new rows go through the pinned stage)."""
    from remote_drafter.models import staging
    copies = []
    real = staging.to_device
    monkeypatch.setattr(staging, "to_device", lambda a, device: copies.append(a.shape) or real(a, device))
    d = fresh(drafter)
    for batch in (1, 3):
        requests = [DraftRequest(history(d, 30 + 5 * i, i), d.max_depth) for i in range(batch)]
        for r in requests:
            copies.clear()
            d.draft(requests, False)
            assert len(copies) == 1, copies
            r.history.extend(np.array([7], np.int32), np.ones((1, d.feature), np.float32))
    ahead = copy.copy(requests[0].history)
    ahead.extend(np.array([8], np.int32), np.ones((1, d.feature), np.float32))
    copies.clear()
    two = d.draft([requests[0], DraftRequest(ahead, d.max_depth)], False)
    assert len(copies) == 1 and len(two) == 2


def test_small_arrays_arrive_whole_as_views_of_one_copy():
    from remote_drafter.models.staging import to_device_all
    arrays = [np.arange(6).reshape(2, 3), np.array([True, False]), np.zeros((0,), np.int64),
              np.array([[2**40]], np.int64)]
    got = to_device_all(arrays, "cpu")
    assert [tuple(t.shape) for t in got] == [(2, 3), (2,), (0,), (1, 1)]
    assert all(t.dtype == torch.int64 for t in got)
    assert [t.tolist() for t in got] == [[[0, 1, 2], [3, 4, 5]], [1, 0], [], [[2**40]]]
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # one tensor: one copy


def test_the_greedy_chain_inside_the_block_is_the_pickers_chain(drafter):
    """A greedy round reads the chain the block computed on the device (inside the CUDA graph
    there): the same tokens and top-two probabilities as the Picker's loop over the same
    block, and the same confidences as every step's in one pass, bit for bit (each step's
    alone agrees to float32 rounding)."""
    d = fresh(drafter)
    requests = [DraftRequest(history(d, 20 + 9 * i, i), d.max_depth) for i in range(3)]
    inputs = d._blank(3)
    inputs[0].normal_(generator=torch.Generator().manual_seed(1))
    inputs[1][:] = torch.tensor([[30, 5, 40], [30, 9, 60], [30, 17, 80]])  # rows kept, seed, its position
    h, z, chain = d._block(*inputs)
    tokens, top_p, top_i, scores = unpack_chain(chain.numpy())
    pick, previous, embedded = Picker(requests, want_probs=False), inputs[1][:, 1], []
    for i in range(d.max_depth):
        m = d.model.markov.embed(previous)
        assert np.allclose(d.model.confidence(h[:, i], m).float().numpy(), scores[:, i], rtol=1e-6, atol=0)
        embedded.append(m)
        previous = pick(d.model.markov.logits(z[:, i], m), [0] * 3)
    # every step's confidence in one pass, as the block and a sampled round compute it
    assert np.array_equal(d.model.confidence(h, torch.stack(embedded, 1)).float().numpy(), scores)
    want = pick.finish()
    got = chain_arrays(tokens, top_p, top_i, top_p[..., 0], None, [True] * 3)
    for a, b in zip(want, got):
        assert (a is None and b is None) or np.array_equal(a, b)


def test_sampled_drafts_draw_from_probabilities_and_the_seed_reproduces(drafter):
    d, h = fresh(drafter), history(drafter, 20, 12)
    drawn = {}
    for seed in range(6):
        a = d.draft([DraftRequest(h, 5, 1.0, seed)], True)[0]
        b = d.draft([DraftRequest(h, 5, 1.0, seed)], True)[0]
        assert a.tokens.tobytes() == b.tokens.tobytes()
        assert np.allclose(a.probs.sum(-1), 1.0, atol=1e-5)
        assert np.allclose(a.probs[np.arange(5), a.tokens], a.own_probs)
        drawn[seed] = tuple(a.tokens)
    assert len(set(drawn.values())) > 1  # seeds draw different chains


def test_the_confidence_cut_off_is_off_by_default_and_shortens_drafts(drafter, folders, monkeypatch):
    d = fresh(drafter)
    requests = [DraftRequest(history(d, 12 + i, 20 + i), 5) for i in range(8)]
    full = d.draft(requests, True)
    assert all(len(x.tokens) == 5 and x.confidence.shape == (5,) for x in full)
    scores = np.concatenate([x.confidence for x in full])
    cutoff = float(np.median(scores))
    cut = fresh(d, cutoff).draft(requests, True)
    for whole, part in zip(full, cut):
        n = len(part.tokens)
        assert np.all(whole.confidence[:n] >= cutoff) and (n == 5 or whole.confidence[n] < cutoff)
        assert np.array_equal(part.tokens, whole.tokens[:n]) and part.probs.shape[0] == n
    assert sum(len(x.tokens) for x in cut) < 5 * len(requests)
    monkeypatch.setenv("REMOTE_DRAFTER_CONFIDENCE_CUTOFF", str(cutoff))
    assert load_drafter("dsv41:" + folders["dsv41"], folders["target"]).confidence_cutoff == cutoff


@pytest.mark.parametrize("variant", ["dsv41", "dsv4"])
def test_a_worker_serves_it_exactly_at_t0(folders, variant):
    """`remote-drafter worker --drafter dsv41:<folder>` through the client, for a V4.1 and a
    V4 checkpoint: decoding with its drafts yields the tokens the target yields alone."""
    target = LlamaLM.load(folders["target"])
    prompts = {1: [1, 2, 3, 4, 5], 2: list(range(10, 150))}  # 2 is longer than the window
    layers = (1, 2, 3)
    worker = WorkerProcess("dsv41:" + folders[variant], folders["target"])
    try:
        client = DrafterClient(RemoteTransport(worker.address, "tcp", expectation(folders["target"], None)),
                               "8:5", deadline_s=20)
        assert tuple(client.transport.info(1).described["drafter"]["hidden_layers"]) == layers
        result = speculative_decode(target, client, prompts, 12, hidden_layers=layers)
        assert result.tokens == {rid: plain_decode(target, p, 12) for rid, p in prompts.items()}
        counters = client.counters()
        assert counters["rounds_failed"] == 0 and counters["drafts"] > 0
    finally:
        worker.stop()


def test_the_gpu_script_runs_in_its_smoke_form(tmp_path):
    """benchmarks/dsv41_gpu.py (the GPU tier's figures for this drafter) at the tiny width on
    the CPU: it builds the drafter from random weights and times rounds locally and through a
    worker over tcp, the worker's own cost apart from the time inside the drafter and from the
    payload's time over a plain socket, so the GPU run cannot fail on a rotten script."""
    import json
    out = tmp_path / "r.json"
    assert benchmark_scripts.load("dsv41_gpu").main(["--device", "cpu", "--width", "tiny", "--batches", "1",
                                               "--rounds", "2", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["flash"]["rounds"]
    assert row["batch"] == 1 and min(row["device_p50_ms"], row["local_p50_ms"], row["tcp_p50_ms"]) > 0
    assert 0 < row["tcp_inside_draft_p50_ms"] < row["tcp_p50_ms"]
    assert row["tcp_worker_own_ms"] == round(row["tcp_p50_ms"] - row["tcp_inside_draft_p50_ms"], 3)
    assert row["wire_p50_ms"] > 0  # the same payload over a plain socket
    assert abs(row["tcp_worker_own_beyond_wire_ms"] - (row["tcp_worker_own_ms"] - row["wire_p50_ms"])) < 2e-3


def test_the_round_script_sets_two_runs_of_the_served_round_side_by_side(tmp_path):
    """drafter_round.py --compare (its GPU run feeds it --experts-ab, or --variants bf16, of the
    code before a change and after, in one call): each batch's p50 and p99 after over before, the worker's
    own cost of both, and where their greedy drafts part, with the gap there; two runs of the
    same code (a BEFORE that did not take) refused."""
    import json

    def run(p50s, tokens, code="/after/remote_drafter"):
        drafts = [{"tokens": t, "own_probs": [0.6] * len(t), "alt_probs": [0.3] * len(t)} for t in tokens]
        return {"device": "H200", "remote_drafter": code, "auto": {"rounds": [{"batch": b, "p50_ms": p, "p99_ms": 2 * p, "p50_over_floor": p}
                                                      for b, p in zip((1, 16), p50s)], "greedy_drafts": drafts},
                "worker_tcp": {"rounds": [{"tcp_worker_own_beyond_wire_ms": 0.5}]}}
    paths = [tmp_path / "before.json", tmp_path / "after.json"]
    paths[0].write_text(json.dumps(run([4.0, 8.0], [[1, 2, 3], [4, 5, 6]], "/before/remote_drafter")))
    paths[1].write_text(json.dumps(run([3.0, 8.0], [[1, 2, 3], [4, 7, 6]])))
    out = tmp_path / "c.json"
    script = benchmark_scripts.load("drafter_round")
    assert script.main(["--compare", *map(str, paths), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["p50_after_over_before"] for r in res["rounds"]] == [0.75, 1.0]
    assert res["rounds"][0]["p99_ms"] == [8.0, 6.0] and res["worker_own_beyond_wire_ms"] == [[0.5], [0.5]]
    assert res["drafts_after_vs_before"] == {"same_greedy_drafts": 1, "requests": 2,
                                             "top_two_gaps_where_they_part": [0.3]}
    paths[0].write_text(json.dumps(run([4.0, 8.0], [[1, 2, 3], [4, 5, 6]])))  # BEFORE missed: this tree twice
    with pytest.raises(SystemExit, match="both runs timed the same code"):
        script.main(["--compare", *map(str, paths), "--out", str(out)])
    # runs of --variants bf16 (gpu.sh =bf16-before-after): their rounds under "bf16", no worker
    for path, p50s, code in zip(paths, ([4.0, 8.0], [2.0, 4.0]), ("/before/remote_drafter", "/after/remote_drafter")):
        bf16 = run(p50s, [[1, 2, 3], [4, 5, 6]], code)
        bf16["bf16"] = bf16.pop("auto")
        del bf16["worker_tcp"]
        path.write_text(json.dumps(bf16))
    assert script.main(["--compare", *map(str, paths), "--compare-mode", "bf16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["p50_after_over_before"] for r in res["rounds"]] == [0.5, 0.5] and "worker_own_beyond_wire_ms" not in res
    assert res["drafts_after_vs_before"]["same_greedy_drafts"] == 2


def test_the_gpu_script_measures_a_worker_in_its_own_process(tmp_path):
    """dsv41_gpu.py --own-process: the worker in a process of its own (as deployed) per batch,
    its draft p50 read from its status, the process waited for once its figure is taken."""
    import json
    out = tmp_path / "p.json"
    assert benchmark_scripts.load("dsv41_gpu").main(["--own-process", "--device", "cpu", "--width", "tiny",
                                               "--batches", "1", "--rounds", "3", "--out", str(out)]) == 0
    [row] = json.loads(out.read_text())["worker_own_process"]
    assert row["batch"] == 1 and row["tcp_p50_ms"] > 0 and row["worker_draft_p50_ms"] > 0
    assert row["worker_own_ms"] == round(row["tcp_p50_ms"] - row["worker_draft_p50_ms"], 3)
    assert row["request_bytes_per_round"] > 0


def test_the_worker_cost_script_splits_a_round_by_phase(tmp_path):
    """benchmarks/worker_cost.py: a stub drafter at the Flash payload, every phase of a round
    timed and (asked for) its page faults counted, local (no link: no messages received or
    sent, no server's turn), over tcp to a
    worker thread and to a worker process (there the client's phases only, and its receives),
    with the same payload over a plain socket beside each; young requests and requests in
    service; rows bf16 end to end then float32 on the hosts (bf16 on the wire both ways: the
    same bytes); the own cost is the round less the time inside `draft`; the phases restored
    afterwards (the service times nothing)."""
    import json
    import socket

    from ofl.channel import Channel
    from ofl.server import Server
    from remote_drafter.worker.service import DraftService
    script = benchmark_scripts.load("worker_cost")
    apply, receive = DraftService._apply, Channel.recv_payload
    out = tmp_path / "w.json"
    assert script.main(["--batches", "2", "--rounds", "3", "--faults", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["rows"], r["requests"], r["via"]) for r in result["rows"]] == [
        (rows, age, via) for rows in ("bfloat16", "float32") for age in ("young", "in_service")
        for via in ("local", "tcp", "tcp_process")]
    for age in ("young", "in_service"):
        assert len({r["request_bytes_per_round"] for r in result["rows"]
                    if r["via"] != "local" and r["requests"] == age}) == 1
    assert result["drafter"] == "stub" and result["device"] == "cpu"
    for r in result["rows"]:
        labels = {label for _, _, label in script.PHASES} | {script.INSIDE_DRAFT}
        assert r["own_p50_ms"] == round(r["round_p50_ms"] - r["inside_draft_p50_ms"], 3)
        # the thread's CPU time within the same calls: never past their wall time (each round's
        # is not, so no percentile of them is)
        assert 0 < r["client_thread_cpu_p50_ms"] <= r["round_p50_ms"] + 0.002
        if r["via"] == "tcp_process":  # drafts as long as the worker thread did (same batch, age)
            [thread] = [t for t in result["rows"] if t["via"] == "tcp" and (t["rows"], t["requests"])
                        == (r["rows"], r["requests"])]
            assert r["inside_draft_p50_ms"] == thread["inside_draft_p50_ms"]
            assert r["inside_draft_from"].startswith("the worker thread's row")
            labels = {label for label in labels if not label.startswith("worker")}
        else:
            assert r["inside_draft_from"] == "this row"
        if r["via"] == "local":
            labels = {label for label in labels if not label.startswith("both") and label != script.TURN}
        assert set(r["phases_p50_ms"]) == set(r["phases_page_faults_per_round"]) == labels
        phases = r["phases_p50_ms"]
        if r["via"] == "tcp":  # the server's turn holds the service's phases
            assert phases[script.TURN] >= phases["worker: parse request"] + phases["worker: encode reply"]
        # what no phase covers: the own cost less the client's and both sides' phases and the
        # worker's (its whole turn over tcp, its phases summed in process, none from the process
        # apart), the time inside `draft` not counted
        worker = {"tcp": phases.get(script.TURN, 0.0),
                  "local": sum(v for k, v in phases.items() if k.startswith("worker: ") and k != script.INSIDE_DRAFT),
                  "tcp_process": 0.0}[r["via"]] - phases.get(script.INSIDE_DRAFT, 0.0)
        timed = worker + sum(v for k, v in phases.items() if k.startswith(("client: ", "both: ")))
        assert abs(r["outside_phases_ms"] - (r["own_p50_ms"] - timed)) < 2e-3
        assert r["own_p50_ms"] > 0 and r["request_bytes_per_round"] > 2 * script.FLASH_FEATURE * 2
        assert ("wire_p50_ms" in r) == ("own_beyond_wire_ms" in r) == (r["via"] != "local")
        if "wire_p50_ms" in r:
            assert r["wire_p50_ms"] > 0 and abs(r["own_beyond_wire_ms"] - (r["own_p50_ms"] - r["wire_p50_ms"])) < 2e-3
    assert DraftService._apply is apply and Channel.recv_payload is receive
    assert "sendmsg" not in vars(socket.socket) and "answer" in vars(Server)  # as they were

    class Drafter:  # a drafter whose draft is its class's method (the Flash drafter's is)
        def draft(self, requests, want_probs):
            return ["drafts"]
    d = Drafter()
    timer = script.PhaseTimer(d)
    try:
        timer.start()
        assert d.draft([], False) == ["drafts"] and len(timer.times[script.INSIDE_DRAFT]) == 1
    finally:
        timer.close()
    assert "draft" not in vars(d) and d.draft([], False) == ["drafts"]
    assert DraftService._apply is apply and Channel.recv_payload is receive


def test_the_worker_cost_script_spins_before_waits_only_while_asked(tmp_path, monkeypatch):
    """--spin-us: every wait of ofl's channels polls without blocking first, for up to that
    long, then blocks for what is left of it (none is left: one look); a poll that finds the
    socket ready ends it. The run measures as usual (the row types and ages asked for only),
    and afterwards the channel waits as before and the worker processes' variable is gone.
    Values it cannot run are refused."""
    import json
    import os

    from ofl.channel import Channel
    script = benchmark_scripts.load("worker_cost")
    monkeypatch.delenv(script.SPIN_ENV, raising=False)

    class Poller:
        def __init__(self, ready_after: int):
            self.polls, self.ready_after = 0, ready_after

        def poll(self, timeout_ms):
            assert timeout_ms == 0  # the spin never blocks
            self.polls += 1
            return [(3, 1)] if self.polls > self.ready_after else []

    blocked = []
    wait = script.spinning(lambda poller, seconds: blocked.append(seconds) or False, 0.002)
    assert wait(Poller(ready_after=3), 10.0) and not blocked  # ready on the fourth look
    assert not wait(Poller(ready_after=10**9), 10.0) and blocked[-1] == pytest.approx(10.0 - 0.002)
    assert not wait(Poller(ready_after=10**9), None) and blocked[-1] is None
    poller = Poller(ready_after=10**9)
    assert not wait(poller, 0.0) and blocked[-1] == 0.0 and poller.polls == 0  # no time: the wait's one look
    assert not wait(Poller(ready_after=10**9), 0.001) and blocked[-1] == 0.0  # shorter than the spin

    ready = vars(Channel)["_ready"]
    out = tmp_path / "spin.json"
    assert script.main(["--batches", "1", "--rounds", "2", "--spin-us", "500", "--row-dtypes", "bfloat16",
                        "--ages", "in_service", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["spin_us"] == 500  # and only the rows asked for
    assert [(r["rows"], r["requests"], r["via"]) for r in result["rows"]] == [
        ("bfloat16", "in_service", via) for via in ("local", "tcp", "tcp_process")]
    assert vars(Channel)["_ready"] is ready and script.SPIN_ENV not in os.environ
    for bad in (["--spin-us", "-1"], ["--row-dtypes", "float16"], ["--ages", "old"]):
        with pytest.raises(SystemExit):
            script.main(bad)


def test_the_exllamav3_check_compares_drafts_and_logits_position_by_position(folders):
    """benchmarks/dsv4_exl3_check.py's comparison (its GPU run feeds it exllamav3's passes) on
    passes recorded from this drafter itself: every chain and logit the same; a pass whose
    third draft was changed is reported at that position, and only its chain differs."""
    script = benchmark_scripts.load("dsv4_exl3_check")
    d = load_drafter("dsv41:" + folders["dsv4"], folders["target"])
    m, c, rng, passes = d.model, d.config, np.random.default_rng(3), []
    for p0 in (7, d.window + 30):
        rows = rng.standard_normal((p0, d.feature)).astype(np.float32)
        seed = int(rng.integers(0, d.vocab_size))
        h = d.new_history()
        h.reset(np.r_[np.zeros(p0, np.int32), seed], rows)
        drafts = d.draft([DraftRequest(h, d.max_depth)], False)[0].tokens.tolist()
        k, n = min(p0, d.window), d.window
        ctx = torch.zeros(1, n, c.n_mtp_layers * c.head_dim)
        ctx[0, n - k:] = m.encode_rows(torch.tensor(rows[p0 - k:]), torch.arange(p0 - k, p0))
        valid = torch.zeros(1, n, dtype=torch.bool)
        valid[0, n - k:] = True
        hidden = m.block_hidden(ctx.view(1, n, c.n_mtp_layers, -1), valid, torch.tensor([seed]),
                                torch.tensor([p0]))
        z, embs = m.head(hidden), [m.markov.embed(torch.tensor([t])) for t in [seed] + drafts[:-1]]
        passes.append({"job": 0, "p0": p0, "seed": seed, "drafts": drafts, "rows": rows,
                       "taps_complete": True,
                       "logits": np.stack([m.markov.logits(z[:, i], e)[0].numpy() for i, e in enumerate(embs)]),
                       "confidence": np.array([float(m.confidence(hidden[:, i], e)) for i, e in enumerate(embs)])})
    changed = {**passes[1], "drafts": passes[1]["drafts"][:2] + [(passes[1]["drafts"][2] + 1) % d.vocab_size]
               + passes[1]["drafts"][3:]}
    got = script.compare(d, passes)
    assert got["chains_identical"] == got["passes_compared"] == 2
    assert got["positions_identical"] == got["positions"] == 2 * d.max_depth
    assert got["max_logit_diff"] < 1e-5 and got["max_confidence_diff"] < 1e-6 and not got["disagreements"]
    got = script.compare(d, passes + [changed])
    assert got["chains_identical"] == 2
    [first, *_] = got["disagreements"]
    assert (first["position"], first["exl3"]) == (2, changed["drafts"][2]) and first["ours_margin"] > 0


def test_draft_agreement_reports_where_drafts_part():
    """testing.draft_agreement (the GPU tests' and benchmarks' comparison of two drafters):
    identical greedy drafts counted, and where two part, the first one's top-two gap there, so
    a near-tie shows as one; a draft cut shorter parts where it ends."""
    from remote_drafter.models.base import Draft
    from remote_drafter.testing import draft_agreement

    def draft(tokens, own, alt):
        t = np.array(tokens, np.int32)
        return Draft(t, None, np.array(own, np.float32), np.zeros_like(t), np.array(alt, np.float32))
    a = [draft([1, 2, 3], [.9, .5, .4], [.05, .49, .3]), draft([4, 5], [.8, .7], [.1, .2]),
         draft([4, 5], [.8, .7], [.1, .2])]
    b = [draft([1, 7, 3], [.9, .5, .4], [.05, .49, .3]), draft([4, 5], [.8, .7], [.1, .2]),
         draft([4], [.8], [.1])]
    got = draft_agreement(a, b)
    assert got["same_greedy_drafts"] == 1 and got["requests"] == 3
    assert np.allclose(got["top_two_gaps_where_they_part"], [0.01, 0.5])


def test_a_capture_collects_dead_cycles_first_and_none_during_it():
    """cuda_graphs.no_collection (around every graph capture): a dead reference cycle, as an
    earlier drafter's graphs sit in, is collected on entry; none while inside, however much is
    allocated; the collector as it was afterwards."""
    import gc
    import weakref

    from remote_drafter.models.cuda_graphs import no_collection

    class Cycle:
        pass

    def dead_cycle(collected: list) -> None:
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        weakref.finalize(a, collected.append, "collected")

    before, during = [], []
    dead_cycle(before)
    with no_collection():
        assert before == ["collected"] and not gc.isenabled()
        dead_cycle(during)
        kept = [Cycle() for _ in range(10 * gc.get_threshold()[0])]  # far past the collector's threshold
        assert during == [] and kept
    assert gc.isenabled()
    gc.collect()
    assert during == ["collected"]


@pytest.mark.parametrize("mode", ["ours", "auto"])
def test_our_expert_kernel_failing_at_start_up_leaves_exllamav3s_serving(folders, mode):
    """Dsv41Model.choose_expert_kernels tunes our kernel on the layer's own routing first (in
    CUDA graphs; auto then times exllamav3's against it): an exception there leaves exllamav3's
    kernels serving every layer and says why. The fused layers are stand-ins here (exllamav3
    needs CUDA; the GPU tier runs the real ones)."""
    model = load_drafter("dsv41:" + folders["dsv41"], folders["target"]).model
    calls = []

    class Failing:
        def tune(self, samples):
            calls.append([x.shape[0] for x, _, _ in samples])
            raise RuntimeError("no kernel for this GPU")
    stand_in_experts(model, lambda j: Failing())
    with pytest.raises(ValueError, match="REMOTE_DRAFTER_EXL3_EXPERTS='fastest'"):
        model.choose_expert_kernels([5], "fastest")
    described, why = model.choose_expert_kernels([5, 10], mode)
    assert why == "it failed on this GPU: RuntimeError: no kernel for this GPU"
    assert described.startswith("exl3 fused (exllamav3's kernels; ours cannot serve: it failed on this GPU")
    assert all(layer.moe.experts.ours is None and layer.moe.experts.ours_at == {} for layer in model.layers)
    assert calls == [[5, 10]]  # the first layer tuned, on both row counts


def stand_in_experts(model, ours) -> None:
    """Every layer's experts a FusedExperts stand-in whose `ours` is ours(layer index) (None:
    refused): exllamav3's layers need CUDA."""
    from remote_drafter.models.dsv41.modules.moe import FusedExperts
    for j, layer in enumerate(model.layers):
        stand_in = object.__new__(FusedExperts)
        stand_in.ours, stand_in.ours_at = ours(j), {}
        stand_in.ours_refusal = None if stand_in.ours is not None else "ValueError: 5-bit trellis"
        layer.moe.experts = stand_in


def test_every_layer_takes_the_first_layers_tuning_or_none_takes_ours(folders):
    """Dsv41Model.choose_expert_kernels: the first layer's tuned configurations serve every layer;
    a first layer ours cannot serve leaves exllamav3's kernels serving every layer (no layer
    runs ours untuned), and status says why."""
    model = load_drafter("dsv41:" + folders["dsv41"], folders["target"]).model
    assert len(model.layers) > 1

    class Tunable:
        plan_refusal, plan_kernel_at = None, {}  # the plan's kernel serves

        def tune(self, samples):
            self.tuned = {x.shape[0]: {"nt": 8, "num_warps": 4, "fill": 32} for x, _, _ in samples}
            self.plan_kernel_at = {x.shape[0]: x.shape[0] < 10 for x, _, _ in samples}  # torch's sort at 10
    stand_in_experts(model, lambda j: Tunable())
    described, why = model.choose_expert_kernels([5, 10], "ours")
    assert why is None and described == ("exl3 fused (ours at [5, 10] rows, exllamav3's at no rows; "
                                         "ours sort with torch at [10] rows (faster there))")
    first = model.layers[0].moe.experts.ours
    assert set(first.tuned) == {5, 10} and all(layer.moe.experts.ours.tuned == first.tuned for layer in model.layers)
    assert all(layer.moe.experts.ours.plan_kernel_at == {5: True, 10: False} for layer in model.layers)
    model.layers[0].moe.experts.ours.plan_refusal = "RuntimeError: no such instruction"  # status says so
    assert model.layers[0].moe.experts.describe() == ("exl3 fused (ours at [5, 10] rows, exllamav3's at no rows; "
                                                      "ours sort with torch: RuntimeError: no such instruction)")
    stand_in_experts(model, lambda j: Tunable() if j else None)
    for mode in ("ours", "auto"):
        described, why = model.choose_expert_kernels([5, 10], mode)
        assert why == "ValueError: 5-bit trellis" and "ours cannot serve: ValueError: 5-bit trellis" in described
        assert all(layer.moe.experts.ours_at == {} for layer in model.layers)


def test_auto_serves_ours_at_the_row_counts_where_it_timed_faster(monkeypatch):
    """FusedExperts.faster_ours: ours tuned first, then ours and exllamav3's kernels each timed
    again on the same call, per row count (the graph timing faked: it needs CUDA)."""
    from types import SimpleNamespace

    from remote_drafter.models.dsv41.modules import moe
    ms = {("ours", 5): 1.0, ("theirs", 5): 2.0, ("ours", 80): 3.0, ("theirs", 80): 2.5}
    tuned = []

    class Ours:
        def tune(self, samples):
            tuned.append([x.shape[0] for x, _, _ in samples])

        def __call__(self, x, weights, experts):
            return "ours", x.shape[0]
    monkeypatch.setattr(moe, "graph_ms", lambda fn, device: ms[fn()])
    fused = object.__new__(moe.FusedExperts)
    fused.ours, fused.kernels = Ours(), lambda x, weights, experts: ("theirs", x.shape[0])
    fused.numerics = SimpleNamespace(device="cpu")
    samples = [(torch.zeros(n, 4), torch.ones(n, 2), torch.zeros(n, 2, dtype=torch.int64)) for n in (5, 80)]
    assert fused.faster_ours(samples) == {5: True, 80: False}
    assert tuned == [[5, 80]]
