"""The EXL3 fidelity gate on the CPU (models/fidelity_gate.py, `exl3 gate`, the worker's
refusal in worker/exl3_admission.py): tiny random DeepSeek-V4.1 drafters stand in for the
reference and the candidate.

exllamav3's kernels need CUDA, so the candidate here is a "dense pack": a pack folder
(exl3.json) that quantises no linear, served with exl3.refusal and load_exllamav3 stubbed
(as test_exl3.py does). That reaches the worker's own gate refusals (no record, failed,
another digest) and the gate command end to end; a real pack through exllamav3 runs on a
GPU in packages/remote-drafter/benchmarks/gpu.sh with ONLY_EXL3_DRAFTER=1."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

import remote_drafter.cli  # noqa: E402
from remote_drafter.models import exl3, fidelity_gate  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint, tiny  # noqa: E402
from remote_drafter.models.dsv41.drafter import Dsv41Drafter  # noqa: E402
from remote_drafter.worker import exl3_admission, round_recorder  # noqa: E402

POSITIONS = (3, 40, 127, 200)  # below, at and above the 128-row window


def dense_pack(src: str, out: str) -> None:
    """A pack with no quantised linear: the checkpoint's drafter as convert_exl3 lays it out."""
    from safetensors.torch import save_file
    loaded = checkpoint.load(src, torch.bfloat16, "cpu")
    os.makedirs(out, exist_ok=True)
    save_file({k: v.contiguous() for k, v in loaded.weights.items()},
              os.path.join(out, checkpoint.SINGLE_FILE))
    config = checkpoint.read_config(src)
    (config.get("text_config") or config).pop("quantization_config", None)
    config.pop("quantization_config", None)
    with open(os.path.join(out, checkpoint.CONFIG_FILE), "w") as f:
        json.dump(config, f)
    exl3.write_pack(out, {"kind": "dsv41", "bits": 16, "linears": []})


@pytest.fixture(scope="module")
def tinies(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    for name, seed in (("a", 0), ("b", 1)):
        tiny.write_tiny(str(root / name), seed=seed)
    dense_pack(str(root / "a"), str(root / "pack"))
    a = Dsv41Drafter.load(str(root / "a"), device="cpu", confidence_cutoff=0.0)
    b = Dsv41Drafter.load(str(root / "b"), device="cpu", confidence_cutoff=0.0)
    return root, a, b


@pytest.fixture(scope="module")
def rounds_a(tinies):
    """rounds_for(a), made once (each round encodes a window of rows: seconds on the CPU)."""
    return rounds_for(tinies[1])


def greedy(drafter, r: fidelity_gate.Round, depth: int) -> np.ndarray:
    return drafter.draft([DraftRequest(fidelity_gate.history_of(drafter, r), depth)], want_probs=False)[0].tokens


def rounds_for(drafter, seed: int = 0) -> list[fidelity_gate.Round]:
    """Random taps and prefixes (MIN_ROUNDS of them, each of POSITIONS in turn); the
    continuation is `drafter`'s own greedy chain."""
    rng = np.random.default_rng(seed)
    out = []
    for t in POSITIONS * (fidelity_gate.MIN_ROUNDS // len(POSITIONS)):
        n = min(t, drafter.window)
        r = fidelity_gate.Round(rng.standard_normal((n, drafter.feature)).astype(np.float16),
                       rng.integers(0, drafter.vocab_size, t + 1), np.zeros(drafter.max_depth, np.int64))
        r.continuation = greedy(drafter, r, drafter.max_depth).astype(np.int64)
        out.append(r)
    return out


def test_a_drafter_against_itself_passes_with_everything_equal(tinies, rounds_a):
    _, a, _ = tinies
    done = []
    result = fidelity_gate.measure(a, a, list(rounds_a), progress=lambda: done.append(1))
    assert len(done) == len(rounds_a)  # progress after every round (the CLI's bar)
    assert result["reference_accepted"] == result["candidate_accepted"] == a.max_depth
    assert result["acceptance_ratio"] == 1.0 and result["passed"]
    assert result["agreement"] == [1.0] * a.max_depth
    assert result["tv"] == 0.0 and result["rounds"] == fidelity_gate.MIN_ROUNDS
    fewer = fidelity_gate.measure(a, a, rounds_a[:len(POSITIONS)])
    assert fewer["acceptance_ratio"] == 1.0 and not fewer["passed"]  # too few rounds to tell


def test_another_drafter_disagrees_and_the_numbers_are_what_its_drafts_give(tinies, rounds_a):
    _, a, b = tinies
    rounds = list(rounds_a)
    result = fidelity_gate.measure(a, b, rounds, goal=0.5)
    mine = [fidelity_gate.accepted(greedy(b, r, a.max_depth), r.continuation) for r in rounds]
    assert result["candidate_accepted"] == pytest.approx(np.mean(mine))
    assert result["reference_accepted"] == a.max_depth
    assert result["acceptance_ratio"] == pytest.approx(np.mean(mine) / a.max_depth)
    assert result["passed"] == (result["acceptance_ratio"] >= 0.5)
    agreement = result["agreement"]
    assert agreement[0] < 1 and all(x >= y for x, y in zip(agreement, agreement[1:]))
    # against the reference's own chains, first-j agreement is the share accepted >= j
    assert agreement == pytest.approx([np.mean([m >= j for m in mine]) for j in range(1, a.max_depth + 1)])
    assert 0 < result["tv"] <= result["tv_max"] <= 1


def test_accepted_length_is_the_prefix_equal_to_the_continuation(tinies, rounds_a):
    _, a, _ = tinies
    rounds = rounds_a[:len(POSITIONS)]  # the rule, not a pass: a few rounds do
    changed = rounds[1].continuation.copy()
    changed[2] = (changed[2] + 1) % a.vocab_size
    rounds[1] = fidelity_gate.Round(rounds[1].taps, rounds[1].prefix, changed)
    result = fidelity_gate.measure(a, a, rounds, depth=4)
    assert result["depth"] == 4
    assert result["reference_accepted"] == pytest.approx((4 * (len(rounds) - 1) + 2) / len(rounds))
    assert result["acceptance_ratio"] == 1.0
    assert fidelity_gate.accepted(np.array([1, 2, 3]), np.array([1, 2, 3, 4])) == 3
    assert fidelity_gate.accepted(np.array([5, 2]), np.array([1, 2])) == 0


def test_a_reference_accepting_nothing_does_not_pass(tinies, rounds_a):
    _, a, _ = tinies
    rounds = [fidelity_gate.Round(r.taps, r.prefix, (r.continuation + 1) % a.vocab_size) for r in rounds_a[:len(POSITIONS)]]
    result = fidelity_gate.measure(a, a, rounds)
    assert result["reference_accepted"] == 0 and result["acceptance_ratio"] is None
    assert not result["passed"]


def test_rows_before_the_stored_ones_are_never_read(tinies, rounds_a):
    """The rounds file keeps min(t, window) rows; a history given every earlier row too
    (zeros here, as benchmarks/dsv4_exl3_check.py lays them out) drafts the same."""
    _, a, _ = tinies
    r = list(rounds_a)[3]  # t = 200 > window
    t = len(r.prefix) - 1
    full = a.new_history()
    full.reset(r.prefix.astype(np.int32),
               np.concatenate([np.zeros((t - len(r.taps), a.feature), np.float32), r.taps.astype(np.float32)]))
    whole = a.draft([DraftRequest(full, a.max_depth)], want_probs=False)[0].tokens
    assert np.array_equal(whole, greedy(a, r, a.max_depth))
    short = fidelity_gate.Round(r.taps[-100:], r.prefix, r.continuation)
    with pytest.raises(ValueError, match="window reads 128"):
        fidelity_gate.measure(a, a, [short])


def test_the_rounds_file_round_trips_and_tolerates_other_tensors(tmp_path, tinies, rounds_a):
    _, a, _ = tinies
    rounds = list(rounds_a)
    path = str(tmp_path / "rounds.safetensors")
    extra = {"embed_ids": np.arange(4, dtype=np.int64), "embed_rows": np.ones((4, 8), np.float16)}
    fidelity_gate.write_rounds(path, rounds, target_digest="t" * 64, extra=extra)
    back, meta = fidelity_gate.read_rounds(path)
    assert meta[fidelity_gate.TARGET_KEY] == "t" * 64 and len(back) == len(rounds)
    for r, s in zip(rounds, back):
        assert s.taps.dtype == np.float16 and np.array_equal(r.taps, s.taps)
        assert s.prefix.dtype == np.int64 and np.array_equal(r.prefix, s.prefix)
        assert np.array_equal(r.continuation, s.continuation)
    fidelity_gate.write_rounds(path, [fidelity_gate.Round(None, np.arange(3), np.arange(2))])
    (only,), meta = fidelity_gate.read_rounds(path)
    assert only.taps is None and fidelity_gate.TARGET_KEY not in meta


def test_the_record_decides_what_may_be_served(tmp_path):
    pack, rounds = str(tmp_path), str(tmp_path / "r.safetensors")
    fidelity_gate.write_rounds(rounds, [fidelity_gate.Round(None, np.arange(3), np.arange(2))], target_digest="t" * 64)
    assert "no fidelity gate record" in exl3_admission.refusal(pack, "d" * 64)
    result = {"rounds": 64, "depth": 5, "reference_accepted": 2.0, "candidate_accepted": 1.8,
              "acceptance_ratio": 0.9, "agreement": [1.0] * 5, "tv": 0.01, "tv_max": 0.02,
              "goal": 0.97, "passed": False}
    fidelity_gate.record(pack, result, "d" * 64, "r" * 64, rounds, "t" * 64)
    why = exl3_admission.refusal(pack, "d" * 64)
    assert "failed the fidelity gate" in why and "1.800" in why and "90.0%" in why and "\n" not in why
    fidelity_gate.record(pack, {**result, "candidate_accepted": 2.0, "acceptance_ratio": 1.0, "passed": True},
                "d" * 64, "r" * 64, rounds, "t" * 64)
    assert exl3_admission.refusal(pack, "d" * 64) is None and exl3_admission.refusal(pack, None) is None
    assert "is for drafter dddddddddddd" in exl3_admission.refusal(pack, "e" * 64)
    assert "target" in exl3_admission.refusal(pack, "d" * 64, target_digest="u" * 64)
    rec = fidelity_gate.read_record(pack)
    assert rec["rounds_sha256"] == fidelity_gate.sha256_file(rounds) and rec["target"] == "t" * 64
    assert rec["reference_drafter"] == "r" * 64 and rec["date"] and rec["version"]
    # a pass at a lower goal of its own does not clear the pack: the worker's bar is GOAL
    fidelity_gate.record(pack, {**result, "goal": 0.8, "passed": True}, "d" * 64, "r" * 64, rounds)
    assert "goal 97%" in exl3_admission.refusal(pack, "d" * 64)
    passed = {**result, "candidate_accepted": 2.0, "acceptance_ratio": 1.0, "passed": True}
    fidelity_gate.record(pack, {**passed, "rounds": fidelity_gate.MIN_ROUNDS - 1}, "d" * 64, "r" * 64, rounds)
    assert f"fewer than the {fidelity_gate.MIN_ROUNDS}" in exl3_admission.refusal(pack, "d" * 64)
    fidelity_gate.record(pack, passed, "d" * 64, "d" * 64, rounds)  # gated against itself
    assert "against its own weights" in exl3_admission.refusal(pack, "d" * 64)


def test_a_pack_quantised_otherwise_than_its_gate_measured_is_refused_by_module(tmp_path):
    """The gate records how each module was stored (from the files' headers); a pack whose
    head was re-quantised at other bits, or left dense, since is refused naming the head,
    before anything is loaded."""
    from safetensors.numpy import save_file
    pack, rounds = str(tmp_path), str(tmp_path / "r.safetensors")
    fidelity_gate.write_rounds(rounds, [fidelity_gate.Round(None, np.arange(3), np.arange(2))])

    def store(head: dict) -> None:
        save_file({"layers.0.attn.wq.trellis": np.zeros((4, 4, 64), np.uint16),
                   "layers.0.attn.wq.suh": np.zeros(64, np.float16),
                   "norm.weight": np.ones(64, np.float16), **head}, os.path.join(pack, "model.safetensors"))

    store({"head.trellis": np.zeros((4, 8, 96), np.uint16)})  # 6 bits
    assert fidelity_gate.pack_formats(pack) == {"layers.0.attn.wq": "exl3 4 bits", "head": "exl3 6 bits",
                                                "norm": "dense F16"}
    passed = {"rounds": 64, "depth": 5, "reference_accepted": 2.0, "candidate_accepted": 2.0,
              "acceptance_ratio": 1.0, "agreement": [1.0] * 5, "tv": 0.0, "tv_max": 0.0, "goal": 0.97,
              "passed": True}
    fidelity_gate.record(pack, passed, "d" * 64, "r" * 64, rounds)
    assert exl3_admission.refusal(pack, None) is None and exl3_admission.refusal(pack, "d" * 64) is None
    store({"head.trellis": np.zeros((4, 8, 64), np.uint16)})  # the head again, at 4 bits
    why = exl3_admission.refusal(pack, None)
    assert "head: exl3 4 bits, gated as exl3 6 bits" in why and "run the gate again" in why, why
    assert "wq" not in why and "\n" not in why
    store({"head.weight": np.zeros((128, 64), np.float16)})  # the head left dense
    assert "head: dense F16, gated as exl3 6 bits" in exl3_admission.refusal(pack, "d" * 64)


def test_the_gate_command_explains_itself(capsys):
    with pytest.raises(SystemExit) as done:
        remote_drafter.cli.main(["exl3", "gate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "accepted length" in out and "total-variation" in out and "exl3-gate.json" in out


@pytest.fixture
def no_gpu_needed(monkeypatch):
    monkeypatch.setattr(exl3, "refusal", lambda device: None)  # as if on a GPU with exllamav3
    monkeypatch.setattr(exl3, "load_exllamav3", lambda log=None: None)


def test_the_gate_command_measures_and_records_a_pack(tinies, rounds_a, tmp_path, capsys, no_gpu_needed):
    root, a, _ = tinies
    rounds = str(tmp_path / "rounds.safetensors")
    fidelity_gate.write_rounds(rounds, list(rounds_a))
    argv = ["exl3", "gate", str(root / "pack"), "--reference", str(root / "a"), "--rounds", rounds,
            "--device", "cpu", "--reference-device", "cpu", "--dtype", "float32"]
    code = remote_drafter.cli.main(argv)
    out = capsys.readouterr().out
    rec = fidelity_gate.read_record(str(root / "pack"))
    assert code == (0 if rec["passed"] else 1), out
    assert ("PASS" if rec["passed"] else "FAIL") in out and "exl3-gate.json" in out
    pack = Dsv41Drafter.load(str(root / "pack"), device="cpu")
    assert rec["drafter"] == fidelity_gate.weights_of(pack.manifest())
    assert rec["reference_drafter"] == fidelity_gate.weights_of(a.manifest())
    # the Markov head is part of the weights the record names (the drafter digest leaves it out)
    other_markov = fidelity_gate.weights_of(replace(pack.manifest(), markov="m" * 64))
    assert exl3_admission.refusal(str(root / "pack"), fidelity_gate.weights_of(pack.manifest())) is None
    assert "is for drafter" in exl3_admission.refusal(str(root / "pack"), other_markov)
    assert rec["rounds"] == fidelity_gate.MIN_ROUNDS and rec["target"] is None
    # the pack holds the reference's weights rounded to bf16: on these rounds it keeps up
    assert rec["acceptance_ratio"] >= 0.97 and code == 0
    assert remote_drafter.cli.main([*argv, "--depth", "9"]) == 2
    assert "depth 9" in capsys.readouterr().err
    itself = [*argv[:4], str(root / "pack"), *argv[5:]]  # --reference the pack itself
    assert remote_drafter.cli.main(itself) == 2
    assert "is an EXL3 pack" in capsys.readouterr().err
    other = str(tmp_path / "other-taps.safetensors")
    fidelity_gate.write_rounds(other, list(rounds_a), hidden_layers=[9, 9, 9])
    assert remote_drafter.cli.main([*argv[:6], other, *argv[7:]]) == 2
    assert "taps of target layers [9, 9, 9]" in capsys.readouterr().err


def worker(drafter: str, *more: str) -> list[str]:
    return ["worker", "--drafter", drafter, "--weights", "exl3", "--device", "cpu",
            "--listen", "127.0.0.1:0", *more]


def test_the_worker_refuses_a_pack_without_a_passed_gate_for_its_weights(tinies, tmp_path, capsys,
                                                                        no_gpu_needed):
    """No record, a failed one: refused before loading; a passed record for other weights:
    refused once the pack is loaded and its digest known. One line, exit 2 each. (A pack
    that passed for its own weights starts serving: the GPU run does that.)"""
    root, a, _ = tinies
    pack = tmp_path / "pack"
    dense_pack(str(root / "a"), str(pack))
    spec = f"dsv41:{pack}"
    assert remote_drafter.cli.main(worker(spec)) == 2
    err = capsys.readouterr().err.strip()
    assert "no fidelity gate record" in err and "exl3 gate" in err and "\n" not in err
    rounds = str(tmp_path / "r.safetensors")
    fidelity_gate.write_rounds(rounds, [fidelity_gate.Round(None, np.arange(3), np.arange(2))])
    result = {"rounds": 64, "depth": 5, "reference_accepted": 2.0, "candidate_accepted": 1.0,
              "acceptance_ratio": 0.5, "agreement": [0.5] * 5, "tv": 0.1, "tv_max": 0.2,
              "goal": 0.97, "passed": False}
    fidelity_gate.record(str(pack), result, "d" * 64, "r" * 64, rounds)
    assert remote_drafter.cli.main(worker(spec)) == 2
    assert "failed the fidelity gate" in capsys.readouterr().err
    fidelity_gate.record(str(pack), {**result, "candidate_accepted": 2.0, "acceptance_ratio": 1.0, "passed": True},
                "d" * 64, "r" * 64, rounds)
    assert remote_drafter.cli.main(worker(spec)) == 2
    err = capsys.readouterr().err.strip()
    assert "is for drafter dddddddddddd" in err and "\n" not in err
    assert "exllamav3" not in sys.modules
    assert remote_drafter.cli.main(["worker", "--drafter", "ngram", "--ungated"]) == 2
    assert "--ungated is for --weights exl3" in capsys.readouterr().err
    # a pack served as dense weights would skip its gate: refused
    assert remote_drafter.cli.main(["worker", "--drafter", spec, "--listen", "127.0.0.1:0"]) == 2
    assert "holds EXL3 weights: serve it with --weights exl3" in capsys.readouterr().err
    assert remote_drafter.cli.main([*worker("ngram")[:-4], "--record-gate-rounds",
                                    str(tmp_path / "missing" / "r.safetensors")]) == 2
    assert "is not a folder this process can write" in capsys.readouterr().err


def test_a_pack_that_passed_its_gate_is_served(tinies, rounds_a, tmp_path, capsys, no_gpu_needed, monkeypatch):
    """The gate's own record for the pack's weights lets the worker start (status: passed)."""
    root, a, _ = tinies
    pack = tmp_path / "pack"
    dense_pack(str(root / "a"), str(pack))
    rounds = str(tmp_path / "rounds.safetensors")
    fidelity_gate.write_rounds(rounds, list(rounds_a))
    assert remote_drafter.cli.main(["exl3", "gate", str(pack), "--reference", str(root / "a"),
                                    "--rounds", rounds, "--device", "cpu", "--dtype", "float32"]) == 0
    served = {}
    import remote_drafter.worker.server as worker_module
    real = worker_module.Worker

    class Recorded(real):
        def start(self):
            served["describe"] = self.service.stats()
            return super().start()
    monkeypatch.setattr(worker_module, "Worker", Recorded)
    monkeypatch.setattr(remote_drafter.cli, "wait_for_shutdown", lambda stop: None)
    assert remote_drafter.cli.main(worker(f"dsv41:{pack}")) == 0
    out = capsys.readouterr().out
    assert "dsv41 drafter" in out and "UNGATED" not in out
    assert served["describe"]["drafter"]["exl3_gate"] == "passed"


def test_ungated_serving_is_marked_in_what_the_worker_describes(tinies):
    _, a, _ = tinies
    drafter = Dsv41Drafter.load(str(tinies[0] / "a"), device="cpu")
    with pytest.raises(exl3_admission.Refused, match="no fidelity gate record"):
        exl3_admission.after_loading(str(tinies[0] / "a"), drafter, False, ungated_ok=False)
    exl3_admission.after_loading(str(tinies[0] / "a"), drafter, False, ungated_ok=True)
    assert drafter.describe()["exl3_gate"].startswith("UNGATED: ") and "no fidelity gate record" in drafter.describe()["exl3_gate"]
    assert "exl3_gate" not in a.describe()


def test_rounds_recorded_while_serving_are_the_targets_own(tmp_path):
    """`worker --record-gate-rounds`: at T = 0 the tokens committed after a round's anchor
    are the target's greedy tokens and the rows sent before it its taps, so each recorded
    round equals what the target itself computes there; the file is a gate rounds file."""
    from remote_drafter.decode_loop import plain_decode, run_target, speculative_decode
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.transport import LocalTransport
    from remote_drafter.models.dspark import DSparkDrafter
    from remote_drafter.models.llama import LlamaLM
    from remote_drafter.testing import HIDDEN_LAYERS, make_models
    from remote_drafter.worker.service import DraftService, ServiceConfig
    paths = make_models(str(tmp_path))
    drafter = DSparkDrafter.load(paths["dspark"], paths["target"])
    target = LlamaLM.load(paths["target"], "cpu")
    path = str(tmp_path / "rounds.safetensors")
    service = DraftService(drafter, ServiceConfig(record_gate_rounds=path, gate_rounds=5,
                                                  gate_depth=3, gate_spacing=7))
    prompts = {0: [5, 9, 2, 7, 11, 3, 8, 1, 4, 6, 10, 12], 1: [20, 21, 22, 23, 24, 25, 26, 27]}
    client = DrafterClient(LocalTransport(service), "64:4")
    out = speculative_decode(target, client, prompts, 30, hidden_layers=HIDDEN_LAYERS)
    assert service.stats()["gate_rounds_recorded"] == 5  # in status while it records
    service.close()
    rounds, meta = fidelity_gate.read_rounds(path)
    assert len(rounds) == 5 and meta[fidelity_gate.TARGET_KEY] == drafter.manifest().target
    sequences = [prompts[rid] + out.tokens[rid] for rid in prompts]
    for rid in prompts:  # speculative decoding at T = 0 is the target's own greedy decoding
        assert out.tokens[rid] == plain_decode(target, prompts[rid], 30)
    for r in rounds:
        t = len(r.prefix) - 1
        seq = next(s for s in sequences if s[:t + 1] == r.prefix.tolist())
        assert r.continuation.tolist() == seq[t + 1:t + 4]
        _, hidden = run_target(target, seq[:t + 1], HIDDEN_LAYERS)
        n = len(r.taps)
        assert n == min(t, drafter.window)
        np.testing.assert_allclose(r.taps.astype(np.float32), hidden[t - n:t].numpy(), rtol=2e-3, atol=2e-3)
    for r in rounds:  # the gate can lay each one out for this drafter (rows cover its window)
        assert fidelity_gate.history_of(drafter, r).length == len(r.prefix)


def test_a_round_beyond_the_kept_tokens():
    """A history keeps its last max_tokens tokens: earlier prefix positions are zeros (the
    gated drafters read the newest token, the length and the window's rows), and a round whose
    continuation left the kept tokens before it completed is dropped, not misrecorded."""
    from remote_drafter.engine.history import History
    recorder = round_recorder.RoundRecorder("/tmp/r.safetensors", 4, 3, None, spacing=1)
    h = History(8, 4, 2)
    tokens = np.arange(100, 120, dtype=np.int32)  # 20 positions, the last 8 kept
    h.reset(tokens, np.ones((19, 2), np.float32))
    recorder.seen("a", h, 0.0)
    t, taps, prefix = recorder.pending["a"]
    assert t == 19 and len(prefix) == 20 and len(taps) == 4
    assert (prefix[:12] == 0).all() and prefix[12:].tolist() == tokens[12:].tolist()
    h.extend(np.array([7, 8, 9], np.int32), np.ones((3, 2), np.float32))
    recorder.seen("a", h, 0.0)
    assert recorder.done[0].continuation.tolist() == [7, 8, 9] and not recorder.pending
    recorder.seen("a", h, 0.0)  # a new round at 22; then 12 tokens at once: its continuation left
    h.extend(np.arange(12, dtype=np.int32), np.ones((12, 2), np.float32))
    recorder.seen("a", h, 0.0)
    assert len(recorder.done) == 1 and not recorder.pending


def test_only_greedy_requests_are_recorded():
    from remote_drafter.engine.history import History
    recorder = round_recorder.RoundRecorder("/nowhere", 2, 3, None, spacing=1)
    h = History(64, 8, 4)
    h.reset(np.arange(10, dtype=np.int32), np.ones((9, 4), np.float32))
    recorder.seen("sampled", h, 1.0)
    assert not recorder.pending
    recorder.seen("greedy", h, 0.0)
    assert list(recorder.pending) == ["greedy"] and recorder.pending["greedy"][0] == 9
    recorder.forget("greedy")
    assert not recorder.pending and not recorder.done
