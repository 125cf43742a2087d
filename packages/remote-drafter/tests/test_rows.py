"""Unit tier: hidden rows on the host in the type they travel in (engine/rows.py), and a
history keeping them in its drafter's type."""

import numpy as np
import pytest

from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.history import History
from remote_drafter.engine.rows import BFLOAT16, all_finite, as_rows, cast, dtype_of


def awkward_floats() -> np.ndarray:
    """Normal values, ties at the bf16 rounding point, subnormals, the largest finite
    float32 (rounds to infinity), infinities, signed zeros."""
    x = np.random.default_rng(1).standard_normal(10_000).astype(np.float32) * 100
    ties = (np.arange(1, 65, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    special = np.array([np.finfo(np.float32).max, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39], np.float32)
    return np.concatenate([x, ties, special])


def test_bf16_cast_rounds_as_torch_does():
    torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")
    x = awkward_floats()
    mine = cast(x, BFLOAT16)
    theirs = torch.from_numpy(x).to(torch.bfloat16)
    assert mine.dtype == BFLOAT16
    assert np.array_equal(mine.view(np.uint16), theirs.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(cast(mine, np.dtype(np.float32)), theirs.float().numpy())


def test_bf16_tensor_rows_are_its_bits_not_a_conversion():
    torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")
    t = torch.from_numpy(awkward_floats()[:12].reshape(2, 6)).to(torch.bfloat16)
    got = as_rows(t)
    assert got.dtype == BFLOAT16 and got.shape == (2, 6)
    assert np.array_equal(got.view(np.uint16), t.view(torch.int16).numpy().view(np.uint16))
    assert as_rows(t.double()).dtype == np.float32 and as_rows(t.half()).dtype == np.float16


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16), BFLOAT16])
def test_all_finite_finds_every_nan_and_infinity(dtype):
    rows = np.ones((3, 5), np.float32)
    assert all_finite(cast(rows, dtype))
    for bad in (np.nan, np.inf, -np.inf):
        r = rows.copy()
        r[2, 4] = bad
        assert not all_finite(cast(r, dtype))
    huge = np.full((1, 2), 7e4, np.float32)  # finite in float32 and bf16, infinity in float16
    with np.errstate(over="ignore"):
        assert all_finite(cast(huge, dtype)) == (dtype != np.float16)


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BFLOAT16])
def test_all_finite_agrees_with_numpy_on_every_half_value(dtype):
    """Each of the 65,536 bit patterns alone, and all of them at once."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    finite = np.isfinite(every.astype(np.float32))
    assert [all_finite(every[i:i + 1]) for i in range(len(every))] == finite.tolist()
    assert not all_finite(every) and all_finite(every[finite]) and all_finite(every[:0])


def test_a_history_keeps_its_drafters_type_and_casts_other_rows():
    h = History(64, 4, 3, dtype_of("bfloat16"))
    rows = np.arange(15, dtype=np.float32).reshape(5, 3) + 0.5
    h.reset(np.arange(6, dtype=np.int32), rows)
    assert h.rows.dtype == BFLOAT16 and np.array_equal(h.rows.astype(np.float32), rows[-4:])
    h.extend(np.array([7], np.int32), cast(np.full((1, 3), 9.25, np.float32), BFLOAT16))
    assert h.rows.dtype == BFLOAT16 and h.rows.astype(np.float32)[-1].tolist() == [9.25] * 3
    assert h.nbytes_max == 4 * 64 + 2 * 2 * 4 * 3  # bf16: half a float32 history's rows
    engine = DrafterClient(transport=None)  # the engine's history: the type of the rows it is given
    engine.add_request(1, np.arange(3, dtype=np.int32), cast(rows[:2], BFLOAT16))
    assert engine.requests[1].history.rows.dtype == BFLOAT16
    assert History(64, 4, 3).rows.dtype == np.float32 and dtype_of("none") == np.float32
