"""History's buffers (engine/history.py: tokens a `Tail`, rows `Chunks`): a snapshot reads
the same items whatever the history appends afterwards, a token buffer nothing else holds is
reused in place, and rows are copied once on append and never moved. CPU."""

import copy
import weakref

import numpy as np

from remote_drafter.engine.history import Chunks, History, Tail


def test_a_tail_keeps_the_newest_items_and_moves_in_place_when_unshared():
    t = Tail(4, (), np.dtype(np.int32))
    t.append(np.arange(4, dtype=np.int32))
    assert len(t.buf) == 8  # twice what it keeps
    first = weakref.ref(t.buf)  # a strong reference would share it
    for i in range(4, 40):
        t.append(np.array([i], np.int32))
        assert t.view().tolist() == list(range(i - 3, i + 1))
    assert t.buf is first()  # 36 appends, several moves: never a new buffer


def test_a_snapshot_reads_its_items_through_appends_and_moves():
    h = History(max_tokens=6, window=3, feature=2)
    h.reset(np.arange(4, dtype=np.int32), np.arange(6, dtype=np.float32).reshape(3, 2))
    snap = copy.copy(h)
    tokens, rows = snap.tokens.copy(), snap.rows.copy()
    shared_tokens = h._tokens.buf
    for i in range(20):  # past the token buffer's end: each move must leave the shared one alone
        h.extend(np.array([100 + i], np.int32), np.full((1, 2), 100.0 + i, np.float32))
        assert h.newest_rows(1)[0, 0] == 100.0 + i
    assert np.array_equal(snap.tokens, tokens) and np.array_equal(snap.rows, rows)
    assert h._tokens.buf is not shared_tokens and h.tokens.tolist() == list(range(114, 120))
    assert h.rows[:, 0].tolist() == [117.0, 118.0, 119.0]
    del snap
    kept = weakref.ref(h._tokens.buf)
    for i in range(20):  # nothing shares it now: moved in place
        h.extend(np.array([200 + i], np.int32), np.full((1, 2), 200.0 + i, np.float32))
    assert h._tokens.buf is kept() and h.rows[:, 0].tolist() == [217.0, 218.0, 219.0]


def test_rows_are_copied_once_into_blocks_and_bounded_by_the_window():
    c = Chunks(5, (2,), np.dtype(np.float32))
    sent = np.arange(6, dtype=np.float32).reshape(3, 2)
    c.append(sent)
    sent[:] = -1  # the sender's buffer (a message) is reused: the rows are a copy
    assert c.view()[:, 0].tolist() == [0.0, 2.0, 4.0]
    for i in range(3, 40):
        before, at, k = c.block, c.at, 1 + i % 2
        c.append(np.full((k, 2), float(i), np.float32))
        assert (c.block is before) == (at + k <= len(before))  # a new block only when one is full
        newest = c.newest(k)
        assert np.shares_memory(newest, c.block)  # the newest rows: a view, no copy
        assert newest[:, 0].tolist() == [float(i)] * k
        assert len(c) == 5 and c.count - len(c.chunks[0]) < 5 and len(c.chunks) <= 3  # bounded
    assert c.view()[:, 0].tolist() == [37.0, 37.0, 38.0, 39.0, 39.0] and c.newest(3)[:, 0].tolist() == [38.0, 39.0, 39.0]
    two = Chunks(5, (1,), np.dtype(np.float32))
    two.append(np.arange(4, dtype=np.float32)[:, None])
    two.append(np.arange(4, 7, dtype=np.float32)[:, None])  # does not fit the first block
    straddling = two.newest(4)  # one row of the first block, three of the second: joined
    assert len(two.chunks) == 2 and straddling[:, 0].tolist() == [3.0, 4.0, 5.0, 6.0]
    assert not straddling.flags.writeable and two.view()[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    c.append(np.full((9, 2), 50.0, np.float32))  # more than it keeps: the newest five
    assert c.view()[:, 0].tolist() == [50.0] * 5 and len(c.chunks) == 1
    assert not c.view().flags.writeable and not c.newest(2).flags.writeable
    c.append(np.zeros((0, 2), np.float32))  # nothing to add changes nothing
    assert c.view()[:, 0].tolist() == [50.0] * 5 and len(Chunks(0, (2,), np.dtype(np.float32))) == 0


def test_a_view_handed_out_keeps_the_buffer_from_being_reused():
    h = History(max_tokens=8, window=2, feature=1)
    h.reset(np.arange(3, dtype=np.int32), np.array([[1.0], [2.0]], np.float32))
    held = h.rows  # e.g. an open's payload still being sent
    for i in range(10):
        h.extend(np.array([i], np.int32), np.array([[10.0 + i]], np.float32))
    assert held[:, 0].tolist() == [1.0, 2.0] and h.rows[:, 0].tolist() == [18.0, 19.0]


def test_a_copy_that_went_further_is_never_overwritten():
    """Two copies appending different rows after one point: each reads its own."""
    a = History(max_tokens=16, window=4, feature=1)
    a.reset(np.arange(2, dtype=np.int32), np.array([[0.0]], np.float32))
    b = copy.copy(a)
    b.extend(np.array([5], np.int32), np.array([[5.0]], np.float32))
    a.extend(np.array([7], np.int32), np.array([[7.0]], np.float32))
    assert b.rows[:, 0].tolist() == [0.0, 5.0] and a.rows[:, 0].tolist() == [0.0, 7.0]
    assert b.tokens.tolist() == [0, 1, 5] and a.tokens.tolist() == [0, 1, 7]
    assert a.lineage is not b.lineage  # the device windows tell them apart


def test_a_dropped_block_is_written_again_unless_a_copy_or_a_view_holds_it():
    c = Chunks(4, (2,), np.dtype(np.float32))
    blocks = []  # each new block, weakly: holding them would keep them from reuse
    for i in range(40):
        before = c.block
        c.append(np.full((1, 2), float(i), np.float32))
        if c.block is not before:
            blocks.append(weakref.ref(c.block))
        del before
    # a block a window long, dropped once the next is full, then written again: two in turn
    assert len(blocks) == 10 and all(b() is blocks[k % 2]() is not None for k, b in enumerate(blocks))
    assert c.view()[:, 0].tolist() == [36.0, 37.0, 38.0, 39.0]
    snapshot, view = copy.copy(c), c.newest(4)  # both hold the current block
    held = c.block
    for i in range(40, 60):
        c.append(np.full((1, 2), float(i), np.float32))
        assert c.block is not held  # never written again while they hold it
    assert snapshot.view()[:, 0].tolist() == view[:, 0].tolist() == [36.0, 37.0, 38.0, 39.0]
    assert c.view()[:, 0].tolist() == [56.0, 57.0, 58.0, 59.0]


def test_one_view_or_one_copy_alone_keeps_a_dropped_block_from_reuse():
    """The refcount rule at its edge: a single holder of either kind is enough."""
    for hold in ("view", "copy"):
        c = Chunks(2, (1,), np.dtype(np.float32))
        for i in range(4):
            c.append(np.full((1, 1), float(i), np.float32))
        held = c.newest(2) if hold == "view" else copy.copy(c)
        for i in range(4, 12):
            c.append(np.full((1, 1), float(i), np.float32))
        rows = held if hold == "view" else held.view()
        assert rows[:, 0].tolist() == [2.0, 3.0], hold
