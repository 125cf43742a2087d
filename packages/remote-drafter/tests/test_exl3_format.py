"""models/exl3_format.py (an EXL3 linear as exllamav3 stores it, read with numpy) against what
exllamav3 1.6.5 itself makes of the same tensors (tests/data/exl3-linears.safetensors, made on a
GPU by benchmarks/exl3_fixture.py: a 4-bit and a 6-bit linear, 256 in and 128 out, quantised as
our packs are): every weight's trellis state and codebook weight bit for bit, the linear's weight
as exllamav3's to its rounding (the rotations' fp32 sums are ordered differently), and
exllamav3's own output for five rows from that weight. No GPU, no exllamav3, no torch."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from remote_drafter.models import exl3_format as F

FIXTURE = load_file(Path(__file__).parent / "data" / "exl3-linears.safetensors")
BITS = [4, 6]


def linear(bits: int) -> dict[str, np.ndarray]:
    return {k.split(".", 1)[1]: v for k, v in FIXTURE.items() if k.startswith(f"{bits}bit.")}


@pytest.mark.parametrize("bits", BITS)
def test_states_and_codebook_weights_are_exllamav3s_bit_for_bit(bits):
    t = linear(bits)
    assert t["mul1"] != 0 and t["trellis"].shape == (16, 8, 16 * bits)
    assert np.array_equal(F.states(t["trellis"], bits), t["states"].view(np.uint16))
    assert np.array_equal(F.decoded(t["trellis"], bits).view(np.uint16), t["decoded"].view(np.uint16))


@pytest.mark.parametrize("bits", BITS)
def test_the_weight_is_exllamav3s_to_its_rounding(bits):
    """Over 99% of the weights bit for bit; the rest within 5e-4 of the largest (an fp16 step
    of the large ones: the rotations' fp32 sums are ordered differently)."""
    t = linear(bits)
    w = F.weight(t["trellis"], t["suh"], t["svh"], bits)
    assert w.shape == t["weight"].shape == (256, 128)
    assert (w.view(np.uint16) == t["weight"].view(np.uint16)).mean() > 0.99
    diff = np.abs(w.astype(np.float32) - t["weight"].astype(np.float32))
    assert diff.max() <= 5e-4 * np.abs(t["weight"]).max()


@pytest.mark.parametrize("bits", BITS)
def test_exllamav3s_output_is_the_rows_times_that_weight(bits):
    """LinearEXL3.forward (its fp16 kernel, the rotations applied to the rows) against x @ W."""
    t = linear(bits)
    w = F.weight(t["trellis"], t["suh"], t["svh"], bits).astype(np.float32)
    want = t["x"].astype(np.float32) @ w
    assert np.abs(t["y"].astype(np.float32) - want).max() <= 2e-3 * np.abs(want).max()


def test_a_transposed_or_shuffled_tile_would_be_caught():
    """The fixture tells the tile order apart: the weights laid out transposed within each
    tile, or in stored order without the fragment order, differ from exllamav3's."""
    t = linear(4)
    values = F.decode(F.states(t["trellis"], 4))  # [16, 8, 256]
    tiles = values.reshape(16, 8, 16, 16)
    plain = tiles.transpose(0, 2, 1, 3).reshape(256, 128)
    transposed = tiles.transpose(0, 3, 1, 2).reshape(256, 128)
    for wrong in (plain, transposed):
        assert not np.array_equal(wrong.view(np.uint16), t["decoded"].view(np.uint16))


def test_codebooks_match_values_worked_by_hand():
    """mul1: state 0 -> x = 0: 1024 · 887/2^17 - 10.3828125 = -3.453125; state 1 -> the bytes
    of 0x83DCD12D sum to 605: 1629 · 887/2^17 - 10.38.. = 0.64107.., rounded to 1313/2048;
    0xFFFF -> x = 0x4D502ED3, sum 414: -0.651474.., rounded to -1334/2048.
    mcg: state 0 -> x = 0x3B603B60, two halves of 0.921875; 0xFFFF -> x = 0x3F20BB73:
    1.78125 - 0.93115234375."""
    assert F.decode(np.array([0, 1, 0xFFFF]), F.MUL1).tolist() == [-3.453125, 1313 / 2048, -1334 / 2048]
    assert F.decode(np.array([0, 0xFFFF]), F.MCG).tolist() == [1.84375, 0.85009765625]
    with pytest.raises(ValueError, match="codebook"):
        F.decode(np.array([0]), "3inst")


def test_states_read_as_int16_decode_as_their_16_bits():
    """exllamav3 stores states as int16: 0x8123 is -32477 there, and decodes as 0x8123."""
    states = np.array([0x8123, 0xFFFF, 0x7FFF], np.uint16)
    for codebook in (F.MUL1, F.MCG):
        assert np.array_equal(F.decode(states.view(np.int16), codebook), F.decode(states, codebook))


def test_the_format_reads_without_torch():
    """numpy alone: a machine with neither torch nor a GPU reads a pack's trellis."""
    done = subprocess.run([sys.executable, "-c", (
        "import sys\n"
        "sys.modules['torch'] = None  # importing it fails\n"
        "import numpy as np\n"
        "from remote_drafter.models import exl3_format\n"
        "print(exl3_format.decoded(np.zeros((1, 1, 64), np.int16), 4).shape)")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(16, 16)"
