"""Which EXL3 linears keep a dense copy (models/exl3_dense.py), on measured times: the
choice alone and the row counts each candidate runs at, on the CPU (the timing and the copies themselves run on CUDA:
tests/test_exl3_experts_gpu.py, by benchmarks/gpu.sh with ONLY_DRAFTER_ROUND=tests)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.models import exl3_dense  # noqa: E402
from remote_drafter.models.dsv41 import checkpoint, tiny  # noqa: E402
from remote_drafter.models.dsv41.config import linear_names  # noqa: E402
from remote_drafter.models.dsv41.drafter import dense_budget_mib  # noqa: E402
from remote_drafter.models.dsv41.model import Dsv41Model  # noqa: E402


class Linear:
    """A linear as choose sees it: its dense copy's size, and where keep_dense put it."""

    def __init__(self, nbytes: int, times: dict[int, tuple[float, float]]):
        self.dense_bytes, self.stored_bytes = nbytes, nbytes // 4
        self.times, self.kept, self.timed = times, None, 0

    def keep_dense(self, from_rows: int) -> None:
        self.kept = from_rows


def timing(linear: Linear, counts: list[int]) -> dict[int, tuple[float, float]]:
    linear.timed += 1
    assert counts == sorted(set(counts))
    return {rows: linear.times[rows] for rows in counts}


def test_a_copy_serves_from_the_fewest_rows_where_it_wins_at_every_count_above():
    assert exl3_dense.threshold({5: (1.0, 2.0), 20: (1.0, 0.5), 80: (2.0, 0.6)}) == 20
    assert exl3_dense.threshold({5: (1.0, 0.5), 20: (1.0, 0.5), 80: (2.0, 0.6)}) == 5
    # faster at few rows but not at the most: no copy (an eager round above the buckets would lose)
    assert exl3_dense.threshold({5: (1.0, 0.5), 80: (1.0, 1.5)}) is None
    # a win inside the margin is not worth the memory
    assert exl3_dense.threshold({5: (1.0, 0.95), 80: (1.0, 0.95)}) is None
    # a loss below a win cuts the range there
    assert exl3_dense.threshold({4: (1.0, 0.1), 16: (1.0, 2.0), 64: (1.0, 0.1)}) == 64


def test_the_copies_saving_most_per_byte_are_kept_within_the_budget():
    linears = {
        "wide": Linear(600, {5: (1.0, 2.0), 80: (3.0, 1.0)}),       # saves 2.0 ms for 600 B
        "dense": Linear(100, {5: (1.0, 0.5), 80: (2.0, 1.0)}),      # saves 1.5 ms for 100 B
        "mid": Linear(500, {5: (1.0, 0.2), 80: (1.0, 0.2)}),        # saves 1.6 ms for 500 B
        "never": Linear(50, {5: (1.0, 1.2), 80: (1.0, 1.1)}),       # never wins
        "huge": Linear(10_000, {5: (9.0, 0.1), 80: (9.0, 0.1)}),    # larger than the budget
        # wins at 5 rows, loses at 80, but runs only at 5 (an encoding-only linear, say)
        "few": Linear(50, {5: (1.0, 0.5), 80: (1.0, 2.0)}),         # saves 0.5 ms for 50 B
    }
    counts = {name: [80, 5, 5] for name in linears}
    counts["few"] = [5]
    chosen = exl3_dense.choose({n: (lin, counts[n]) for n, lin in linears.items()}, 1000, timing)
    # per byte: dense 0.015, few 0.01, wide 0.0033, mid 0.0032 -> dense, few, wide; mid no longer fits
    assert [c.name for c in chosen] == ["dense", "few", "wide"]
    assert {n: lin.kept for n, lin in linears.items()} == \
        {"wide": 80, "dense": 5, "mid": None, "never": None, "huge": None, "few": 5}
    assert chosen[2] == exl3_dense.Choice("wide", 80, 2.0, 600, 150)
    assert linears["huge"].timed == 0  # not even timed: it could never fit
    assert all(lin.timed == 1 for n, lin in linears.items() if n != "huge")  # all counts in one call
    assert exl3_dense.describe(chosen) == {"bytes": 750, "from_rows": {"dense": 5, "few": 5, "wide": 80}}


def test_a_zero_budget_keeps_no_copy_and_times_nothing():
    lin = Linear(100, {5: (1.0, 0.1)})
    assert exl3_dense.choose({"a": (lin, [5])}, 0, timing) == []
    assert exl3_dense.choose({"a": (lin, [])}, 1000, timing) == []  # runs at no row count measured
    assert lin.kept is None and lin.timed == 0


@pytest.mark.parametrize("value, want", [("1024", 1024), ("0", 0), (" 64 ", 64)])
def test_the_budget_variable_reads_whole_mib(monkeypatch, value, want):
    monkeypatch.setenv("REMOTE_DRAFTER_EXL3_DENSE_MIB", value)
    assert dense_budget_mib() == want


@pytest.mark.parametrize("value", ["1.5", "-1", "lots", ""])
def test_a_bad_budget_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("REMOTE_DRAFTER_EXL3_DENSE_MIB", value)
    with pytest.raises(ValueError, match="REMOTE_DRAFTER_EXL3_DENSE_MIB=.*whole number of MiB"):
        dense_budget_mib()


def test_a_kept_copy_serves_from_its_row_count_and_is_made_once():
    class Copyable(exl3_dense.DenseCopy):
        made = 0

        def dense(self):
            self.made += 1
            return object()

    lin = Copyable()
    assert lin.weight_for(1000) is None  # no copy kept: the kernel at every row count
    lin.keep_dense(5)
    weight = lin.dense_weight
    assert [lin.weight_for(r) for r in (1, 4)] == [None, None]
    assert lin.weight_for(5) is weight and lin.weight_for(80) is weight
    lin.keep_dense(20)  # chosen again: the same copy (a graph may read it), a new threshold
    assert lin.made == 1 and lin.dense_weight is weight and lin.weight_for(5) is None


class Served(exl3_dense.DenseCopy):
    """A served linear as dense_candidates sees one: x @ W.T, and may keep a copy."""

    def __init__(self, weight):
        self.weight = weight

    def __call__(self, x):
        return x @ self.weight.T


def test_each_candidate_is_timed_at_the_row_counts_it_runs_at(tmp_path):
    """The block's linears at a round's rows, the taps' projection at the encoding's new
    rows, wkv (a block's and the context's key/value rows) at both; the routed and shared
    experts' linears are not candidates (the shared expert is one once its layer is fused)."""
    tiny.write_tiny(str(tmp_path))
    loaded = checkpoint.load(str(tmp_path), torch.float32)
    c, w = loaded.config, loaded.weights
    names = [n for n in linear_names(c) if not n.endswith(".attn.wo_a.weight")]
    model = Dsv41Model(c, {n: t for n, t in w.items() if n not in names},
                       linears={n: Served(w[n]) for n in names})
    got = {n: rows for n, (_, rows) in model.dense_candidates([5, 10], [4]).items()}
    assert got and not any(".ffn." in n for n in got)
    for name, rows in got.items():
        want = [4] if name.endswith(".main_proj.weight") else \
            [5, 10, 4] if name.endswith(".attn.wkv.weight") else [5, 10]
        assert rows == want, name
    assert sum(n.endswith(".main_proj.weight") for n in got) == 1
    assert sum(n.endswith(".attn.wkv.weight") for n in got) == c.n_mtp_layers
