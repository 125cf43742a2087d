"""Row-id hashing: the vectorised numpy version against a literal transcription of
ARCHITECTURE.md § Engram hashing, its properties, and the torch version against numpy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_engram.geometry import EngramGeometry
from remote_engram.hashing import row_ids

GEO = EngramGeometry(layers=(1, 14), vocab=50, prime_start=1000)
VOCAB = 64  # raw tokenizer ids
TOKEN_MAP = np.random.default_rng(5).integers(0, 50, VOCAB)


def reference(geo, layer, seq, valid, token_map, pad=2):
    """ARCHITECTURE.md § Engram hashing word for word, one position at a time."""
    out = []
    for t in range(len(seq)):
        s, dead = [], False
        for d in range(geo.max_order):
            pos = t - d
            dead = dead or pos < 0 or not valid[pos]
            s.append(int(token_map[pad]) if dead else int(token_map[seq[pos]]))
        m = [int(x) for x in geo.mults[layer]]
        mix = s[0] * m[0]
        rows = []
        for i, n in enumerate(geo.orders):
            mix ^= s[n - 1] * m[n - 1]
            for h in range(geo.heads):
                col = i * geo.heads + h
                rows.append(mix % int(geo.primes[layer][col]) + int(geo.offsets[layer][col]))
        out.append(rows)
    return np.array(out, np.int64).reshape(len(seq), geo.columns)


seqs = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), min_size=1,
                max_size=4)


@settings(max_examples=60, deadline=None)
@given(seqs=seqs, data=st.data())
def test_matches_reference_with_dead_positions(seqs, data):
    length = max(map(len, seqs))
    tokens = np.full((len(seqs), length), 2, np.int64)
    valid = np.zeros((len(seqs), length), bool)
    for b, s in enumerate(seqs):
        tokens[b, :len(s)] = s
        valid[b, :len(s)] = data.draw(st.lists(st.booleans(), min_size=len(s), max_size=len(s)))
    for layer in GEO.layers:
        got = row_ids(GEO, layer, tokens, TOKEN_MAP, valid)
        for b in range(len(seqs)):
            assert np.array_equal(got[b], reference(GEO, layer, tokens[b], valid[b], TOKEN_MAP))


def test_batch_equals_one_by_one_and_rows_in_range():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (5, 30))
    both = row_ids(GEO, 14, tokens, TOKEN_MAP)
    for b in range(5):
        assert np.array_equal(both[b], row_ids(GEO, 14, tokens[b:b + 1], TOKEN_MAP)[0])
    for col in range(GEO.columns):
        lo = GEO.offsets[14][col]
        assert ((both[..., col] >= lo) & (both[..., col] < lo + GEO.primes[14][col])).all()


def test_sequence_start_is_padding():
    # At t = 0 every longer offset is before the start: s_1.. = map[pad]. A sequence that
    # begins with the pad token itself hashes the same at t = 0 and t = 1 for order 2.
    seq = np.array([[7, 9, 11]])
    padded = np.array([[2, 7, 9, 11]])
    a = row_ids(GEO, 1, seq, TOKEN_MAP)
    b = row_ids(GEO, 1, padded, TOKEN_MAP)
    assert np.array_equal(a[0, 0], b[0, 1])  # same window (pad, 7)
    assert not np.array_equal(a[0, 1], a[0, 0])


def test_masked_position_cuts_the_window():
    seq = np.array([[5, 6, 7, 8]])
    valid = np.array([[True, False, True, True]])
    got = row_ids(GEO, 1, seq, TOKEN_MAP, valid)
    # Position 2 sees position 1 dead: its window is (7, pad, pad, pad) as at a start.
    assert np.array_equal(got[0, 2], row_ids(GEO, 1, np.array([[7]]), TOKEN_MAP)[0, 0])


def test_columns_select_a_rank():
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 9))
    full = row_ids(GEO, 1, tokens, TOKEN_MAP)
    assert np.array_equal(row_ids(GEO, 1, tokens, TOKEN_MAP, columns=(12, 24)), full[..., 12:])


def test_rejects_ids_outside_the_map():
    with pytest.raises(ValueError, match="token ids"):
        row_ids(GEO, 1, np.array([[VOCAB]]), TOKEN_MAP)


def test_torch_equals_numpy_on_random_inputs():
    torch = pytest.importorskip("torch", reason="torch is not in this venv (the torch-free "
                                "check); the main .venv has it and runs this")
    from remote_engram.vllm.hashing import row_ids as row_ids_torch

    rng = np.random.default_rng(2)
    from remote_engram.geometry import V41

    token_map = rng.integers(0, V41.vocab, 1000)
    for _ in range(5):
        tokens = rng.integers(0, 1000, (3, 40))
        valid = rng.random((3, 40)) > 0.1
        for layer in V41.layers:
            want = row_ids(V41, layer, tokens, token_map, valid)
            got = row_ids_torch(V41, layer, torch.from_numpy(tokens), torch.from_numpy(token_map),
                                torch.from_numpy(valid))
            assert np.array_equal(got.numpy(), want)
            part = row_ids_torch(V41, layer, torch.from_numpy(tokens), torch.from_numpy(token_map),
                                 torch.from_numpy(valid), columns=(0, 12))
            assert np.array_equal(part.numpy(), want[..., :12])
