"""History's buffers (engine/history.py: tokens a `Tail`, rows `Chunks` drawing blocks from a
`BlockPool`): a snapshot reads the same items whatever the history appends afterwards, a token
buffer nothing else holds is reused in place, rows are copied once on append and never moved,
and a block nothing holds any more serves the next history. CPU."""

import copy
import weakref

import numpy as np

from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.history import BlockPool, Chunks, History, Tail
from remote_drafter.engine.transport import LocalTransport
from remote_drafter.models.ngram import NgramDrafter
from remote_drafter.worker.service import DraftService


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


def test_a_deep_copy_reads_its_own_appends_and_hands_out_read_only_views():
    """Tokens and rows are handed out as slices of one read-only view per buffer: a deep copy
    gets that view remade over its own buffers, so what it appends is what it reads."""
    h = History(max_tokens=6, window=3, feature=2)
    h.reset(np.arange(4, dtype=np.int32), np.arange(6, dtype=np.float32).reshape(3, 2))
    deep = copy.deepcopy(h)
    assert not deep.tokens.flags.writeable and not deep.rows.flags.writeable  # before any append
    for i in range(10):  # within the buffers, then past them (moves, new blocks)
        deep.extend(np.array([50 + i], np.int32), np.full((1, 2), 50.0 + i, np.float32))
        assert deep.tokens[-1] == 50 + i and deep.newest_rows(1)[0, 0] == 50.0 + i
    assert deep.tokens.tolist() == list(range(54, 60)) and deep.rows[:, 0].tolist() == [57.0, 58.0, 59.0]
    assert h.tokens.tolist() == [0, 1, 2, 3] and h.rows[:, 0].tolist() == [0.0, 2.0, 4.0]
    for view in (h.tokens, h.rows, h.newest_rows(1), deep.tokens, deep.rows, deep.newest_rows(2)):
        assert not view.flags.writeable


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
    c = Chunks(4, (2,), np.dtype(np.float32), BlockPool(1 << 20))
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
        c = Chunks(2, (1,), np.dtype(np.float32), BlockPool(1 << 20))
        for i in range(4):
            c.append(np.full((1, 1), float(i), np.float32))
        held = c.newest(2) if hold == "view" else copy.copy(c)
        for i in range(4, 12):
            c.append(np.full((1, 1), float(i), np.float32))
        rows = held if hold == "view" else held.view()
        assert rows[:, 0].tolist() == [2.0, 3.0], hold


def test_a_released_history_s_blocks_serve_the_next_unless_a_snapshot_holds_them():
    pool = BlockPool(1 << 20)
    a = Chunks(4, (2,), np.dtype(np.float32), pool)
    a.append(np.ones((6, 2), np.float32))  # two blocks
    blocks = [weakref.ref(c.base) for c in a.chunks]
    snapshot = copy.copy(a)
    a.release()
    assert len(a) == 0 and a.block is None and not a.chunks
    b = Chunks(4, (2,), np.dtype(np.float32), pool)
    b.append(np.full((1, 2), 7.0, np.float32))
    assert all(b.block is not ref() for ref in blocks)  # the snapshot holds both
    assert snapshot.view()[:, 0].tolist() == [1.0] * 4
    del snapshot
    c = Chunks(4, (2,), np.dtype(np.float32), pool)
    c.append(np.full((1, 2), 8.0, np.float32))
    assert any(c.block is ref() for ref in blocks)  # free now: no fresh memory
    assert Chunks(4, (3,), np.dtype(np.float32), pool).pool.take(4, (3,), np.dtype(np.float32)).shape == (4, 3)
    assert b.view()[:, 0].tolist() == [7.0] and c.view()[:, 0].tolist() == [8.0]
    partly = Chunks(4, (2,), np.dtype(np.float32), pool)
    partly.append(np.ones((2, 2), np.float32))
    unwritten, kept = weakref.ref(partly.block), pool.kept
    partly.release()  # a block written only partly faults past its rows: left to the allocator
    assert unwritten() is None and pool.kept == kept
    deep = copy.deepcopy(c)  # its chunks are arrays of their own, not views of a block
    deep.append(np.full((4, 2), 9.0, np.float32))  # drops its first chunk
    deep.release()
    assert deep.pool is pool and c.view()[:, 0].tolist() == [8.0]


def test_the_pool_keeps_at_most_its_bytes_and_only_blocks_of_the_shape_asked_for():
    pool = BlockPool(16 * 4 * 2 * 4)  # sixteen blocks of 4 x 2 float32
    blocks = [np.empty((4, 2), np.float32) for _ in range(17)]
    for block in blocks + blocks[-1:]:  # a block given twice is kept once
        pool.give(block)
    assert pool.kept == 16 * blocks[0].nbytes
    refs = [weakref.ref(b) for b in blocks]
    del blocks, block
    assert refs[0]() is None and all(r() is not None for r in refs[1:])  # the oldest left
    pool.give(np.empty((5, 2), np.float32))  # a sixteenth of the pool or more: not kept
    assert pool.kept == 16 * 4 * 2 * 4
    assert pool.take(4, (3,), np.dtype(np.float32)) is not refs[1]()  # another shape: a new one
    assert pool.take(8, (2,), np.dtype(np.float32)).shape == (8, 2)  # longer: a new one too
    taken = [pool.take(4, (2,), np.dtype(np.float32)) for _ in range(16)]
    assert [t is r() for t, r in zip(taken, refs[::-1])] == [True] * 16  # the newest first
    assert pool.kept == 0


class RowReadingNgram(NgramDrafter):
    """An n-gram drafter that takes hidden rows, as a DSpark drafter does."""
    feature, hidden_layers = 1024, (3,)

    def __init__(self):
        super().__init__(vocab_size=100, max_depth=2)
        self.window = 8


def test_a_released_request_s_rows_go_to_the_next_request_on_both_hosts():
    """The client and the worker each hand a released request's blocks to the next one: a
    new request's first rows land in memory already touched."""
    service = DraftService(RowReadingNgram())
    client = DrafterClient(LocalTransport(service), "8:2", row_dtype="float32")
    tokens, rows = np.arange(12, dtype=np.int32) % 7, np.ones((11, 1024), np.float32)

    def blocks(rid: int) -> tuple:
        (session,) = [s for key, s in service.sessions.items() if key[2] == rid]
        return session.history._rows.block, client.requests[rid].history._rows.block

    client.add_request(1, tokens, rows)
    client.propose()
    first = [weakref.ref(b) for b in blocks(1)]
    client.release(1)
    client.add_request(2, tokens, rows)
    client.propose()  # the release goes with this round, before the open
    assert [b is ref() for b, ref in zip(blocks(2), first)] == [True, True]
    client.release(2)
    client.add_request(2, tokens, rows)  # the id reused at once: the worker re-opens it
    client.propose()
    assert [b is ref() for b, ref in zip(blocks(2), first)] == [True, True]
    client.add_request(2, tokens, rows)  # and without a release
    client.propose()
    assert [b is ref() for b, ref in zip(blocks(2), first)] == [True, True]
    assert client.counters()["rounds_failed"] == 0
