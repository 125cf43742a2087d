"""benchmarks/exl3_gemv.py (an EXL3 linear at a few rows through a Triton kernel of our own that
reads exllamav3's stored 4-bit trellis) against models/exl3_format.py and against exllamav3's
own output (tests/data/exl3-linears.safetensors): the kernel's product with the decoded weight
within fp32 rounding, for 1 to 5 rows and split over the input or not, and the whole linear
(rotations included) as exllamav3's LinearEXL3 computes it. Without a GPU (CI) the kernel runs
in Triton's CPU interpreter; the GPU run (exl3_gemv.py itself) times it against exllamav3."""

import os
from pathlib import Path

import benchmark_scripts
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")
if not torch.cuda.is_available():  # before Triton defines a kernel: it picks interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="needs Triton: remote-drafter[test] installs it")
from safetensors.numpy import load_file  # noqa: E402

from remote_drafter.models import exl3_format  # noqa: E402

G = benchmark_scripts.load("exl3_gemv")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T = {k.split(".", 1)[1]: v for k, v in
     load_file(Path(__file__).parent / "data" / "exl3-linears.safetensors").items() if k.startswith("4bit.")}


def on_device(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).to(DEVICE)


@pytest.mark.parametrize("rows,splits", [(1, 1), (3, 2), (5, 4)])
def test_the_kernel_multiplies_by_the_decoded_weight(rows, splits):
    x = np.random.default_rng(rows).standard_normal((rows, 256)).astype(np.float16)
    got = G.OneExpert(on_device(T["trellis"]), None, None, rows).inner(on_device(x), splits).cpu().numpy()
    want = x.astype(np.float64) @ exl3_format.decoded(T["trellis"], 4).astype(np.float64)
    assert got.shape == (rows, 128)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_the_linear_is_exllamav3s():
    x = on_device(T["x"])
    got = G.OneExpert(on_device(T["trellis"]), on_device(T["suh"]), on_device(T["svh"]), len(x)).linear(x, 2)
    want = T["y"].astype(np.float32)
    assert np.abs(got.cpu().numpy().astype(np.float32) - want).max() <= 2e-3 * np.abs(want).max()


def test_other_bit_widths_are_refused():
    trellis = np.zeros((16, 8, 96), np.int16)
    with pytest.raises(ValueError, match="4-bit trellis, not 6-bit"):
        G.OneExpert(on_device(trellis), None, None, 1)
