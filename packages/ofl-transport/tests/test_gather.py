"""Unit tier: the compiled gather loop equals the numpy fallback, byte for byte."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ofl import gather


def test_compiled_helper_is_built():
    assert gather.lib is not None, "ofl._gather_cffi was not built (a C compiler is needed)"


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 5000), data=st.data(), fixed=st.booleans())
def test_compiled_equals_numpy(size, data, fixed):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    count = data.draw(st.integers(0, 40))
    if fixed:
        length = data.draw(st.integers(1, size))
        offsets = np.array(data.draw(st.lists(st.integers(0, size - length), min_size=count,
                                              max_size=count)), np.uint64)
        lengths, total = length, length * count
    else:
        pairs = data.draw(st.lists(st.integers(0, size).flatmap(
            lambda o: st.tuples(st.just(o), st.integers(0, size - o))), min_size=count,
            max_size=count))
        offsets = np.array([o for o, _ in pairs], np.uint64)
        lengths = np.array([n for _, n in pairs], np.uint32)
        total = int(lengths.sum())
    a, b = np.full(total + 3, 7, np.uint8), np.full(total + 3, 7, np.uint8)
    gather.gather_into(src, offsets, lengths, a)
    gather.gather_into_numpy(src, offsets, lengths, b)
    assert np.array_equal(a, b) and (a[total:] == 7).all()
