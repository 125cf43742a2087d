"""benchmarks/exl3_decode_rate.py (how fast our own Triton kernels decode EXL3 4-bit trellis
weights on a GPU): its numpy reference against values worked by hand, and its kernels against
that reference: the decoded weights bit for bit, the GEMV's partials within fp32 rounding, the
decode-only XOR and the read kernel's word sums exactly; then the script's smoke form.
Without a GPU (CI) the kernels run in Triton's CPU interpreter, the pure-Triton decodes only;
with one they are compiled and the inline-PTX decodes are checked too."""

import json
import os

import benchmark_scripts
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")
if not torch.cuda.is_available():  # before Triton defines a kernel: it picks interpreter or compiler then
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="needs Triton: remote-drafter[test] installs it")

B = benchmark_scripts.load("exl3_decode_rate")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DECODES = [(cb, how) for cb in (B.MUL1, B.MCG) for how in (B.PURE, B.ASM)]
DECODES += [(B.MUL1, B.ASM_VABSDIFF)]
DECODE_IDS = [f"{'mul1' if cb == B.MUL1 else 'mcg'}-{['pure', 'asm', 'vabsdiff4'][how]}" for cb, how in DECODES]


def needs_cuda(how):
    if how != B.PURE and not CUDA:
        pytest.skip("inline PTX: the interpreter cannot run it; benchmarks/gpu.sh with ONLY_DRAFTER_ROUND=decode runs it on an H200")


def random_words(tiles: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**32, tiles * B.TILE_WORDS, dtype=np.uint32)


def on_device(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.view(np.int32)).to(DEVICE)


def test_states_follow_the_bitstream_and_wrap_within_the_tile():
    """Weight j's state is bits [4j, 4j + 16) of its tile's stream, low bit first; the last
    three take their high bits from word 0 of the same tile, not of the next (all ones here)."""
    words = np.zeros(2 * 32, dtype=np.uint32)
    words[0], words[31], words[32] = 0x87654321, 0xABCD0000, 0xFFFFFFFF
    states = B.tile_states(words)
    assert [hex(s) for s in states[:9]] == ["0x4321", "0x5432", "0x6543", "0x7654", "0x8765",
                                            "0x876", "0x87", "0x8", "0x0"]
    assert [hex(s) for s in states[252:256]] == ["0xabcd", "0x1abc", "0x21ab", "0x321a"]
    assert [hex(s) for s in states[256 + 4:256 + 9]] == ["0xffff", "0xfff", "0xff", "0xf", "0x0"]


@pytest.mark.parametrize("cb,how", DECODES, ids=DECODE_IDS)
def test_the_decode_kernel_gives_the_reference_weights_bit_for_bit(cb, how):
    needs_cuda(how)
    words = random_words(8, seed=cb)
    got = B.decode_tiles(on_device(words), cb, how).cpu().numpy()
    want = B.decode(B.tile_states(words), cb)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("use", [B.GEMV, B.XOR], ids=["gemv", "xor"])
@pytest.mark.parametrize("cb,how", DECODES, ids=DECODE_IDS)
def test_the_gemv_kernel_covers_each_programs_chunks(cb, how, use):
    """Three programs over five chunks of four tiles (programs 0 and 1 loop twice): each
    partial is the reference's sum over its chunks, within fp32 rounding of its terms, or the
    XOR of their weights' bits, exactly."""
    needs_cuda(how)
    tiles, programs = 4, 3
    words = random_words(5 * tiles, seed=10 + cb)
    act = np.random.default_rng(1).standard_normal(B.TILE_WEIGHTS).astype(np.float16)
    got, _ = B.run_gemv(on_device(words), torch.from_numpy(act).to(DEVICE), cb, how, use, tiles, 1, programs)
    chunks = words.reshape(5, -1)
    for p, partial in enumerate(got.cpu().numpy()):
        mine = chunks[p::programs].reshape(-1)
        if use == B.XOR:
            assert int(partial.view(np.uint32)) == B.xor(mine, cb), p
            continue
        w = B.decode(B.tile_states(mine), cb).astype(np.float64).reshape(-1, B.TILE_WEIGHTS)
        scale = np.abs(w * act.astype(np.float64)).sum()
        assert abs(float(partial) - B.gemv(mine, act, cb)) <= 1e-5 * scale, p


@pytest.mark.parametrize("with_next", [0, 1])
def test_the_read_kernel_sums_each_programs_words(with_next):
    tiles, programs = 4, 3
    words = random_words(5 * tiles, seed=20)
    got, _ = B.run_read(on_device(words), with_next, tiles, 1, programs)
    chunks = words.reshape(5, -1).astype(np.uint64)
    want = [int(chunks[p::programs].sum()) * (1 + with_next) % 2**32 for p in range(programs)]
    assert got.cpu().numpy().view(np.uint32).tolist() == want


@pytest.mark.skipif(CUDA, reason="the smoke form is the interpreter's; on CUDA the script is the GPU run")
def test_the_script_runs_in_its_smoke_form(tmp_path):
    out = tmp_path / "r.json"
    assert B.main(["--device", "cpu", "--mib", "0.5", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row["variant"]: row for row in result["variants"]}
    assert list(rows) == ["read", "read+next", "mul1/pure", "mcg/pure"]  # inline PTX: CUDA only
    assert result["buffer_bytes"] == 2**19 and rows["read"]["vs_read"] == 1
    for name in ("mul1/pure", "mcg/pure"):
        assert rows[name]["weights_exact"] and rows[name]["gemv_error"] < 1e-5
        assert rows[name]["gb_s"] > 0 and rows[name]["gweights_s"] == 2 * rows[name]["gb_s"]
