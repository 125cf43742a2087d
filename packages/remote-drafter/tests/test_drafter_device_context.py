"""Unit tier: the incremental, device-resident context (History's amortised appends, the
DSpark drafter's per-request windows) drafts bit-identically to the full rebuild it
replaced, which lives here only as the reference: an old-style history (concatenate and
cut on every commit) and a fresh host array per round, copied to the device."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.engine import protocol as P  # noqa: E402
from remote_drafter.engine.history import History  # noqa: E402
from remote_drafter.engine.rows import cast  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.models.dspark import DSparkDrafter  # noqa: E402
from remote_drafter.models.registry import load_drafter  # noqa: E402
from remote_drafter.worker.service import LOCAL_PEER, DraftService, ServiceConfig  # noqa: E402

CLIENT = 7


class RefHistory:
    """History as it was: every commit concatenates and keeps the last `window` rows."""

    def __init__(self, max_tokens, window, feature):
        self.max_tokens, self.window, self.feature = max_tokens, window, feature
        self.tokens = np.zeros(0, np.int32)
        self.rows = np.zeros((0, feature), np.float32)
        self.length = 0

    def reset(self, tokens, rows, length=None):
        self.tokens, self.rows, self.length = np.zeros(0, np.int32), np.zeros((0, self.feature), np.float32), 0
        self.extend(tokens, rows)
        if length is not None:
            self.length = length

    def extend(self, tokens, rows):
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, np.int32)])[-self.max_tokens:]
        if rows is not None and len(rows):
            self.rows = np.concatenate([self.rows, np.asarray(rows, np.float32)])[-self.window:]
        self.length += len(tokens)


class FullRebuild(DSparkDrafter):
    """The round's inputs as they were built: a fresh host array each round, then copied."""

    def _inputs(self, requests, device):
        b, n = len(requests), self.window
        valid, pos = np.zeros((b, n), bool), np.zeros((b, n), np.int64)
        ctx = np.zeros((b, n, self.feature), np.float32)
        for i, r in enumerate(requests):
            h = r.history
            m = len(h.rows)
            if m:
                ctx[i, n - m:] = h.rows
                valid[i, n - m:] = True
                pos[i, n - m:] = np.arange(h.length - 1 - m, h.length - 1)
        return tuple(torch.from_numpy(a).to(device) for a in (ctx, valid, pos))


def drafters(models, dtype):
    d = load_drafter(models["dspark"], models["target"], dtype=getattr(torch, dtype))
    return d, FullRebuild(d.config, d.model, d.manifest(), d.device)


def windows(d) -> int:
    return len(d._windows.get("cpu", {}))


def assert_same(got, want):
    for name in ("tokens", "probs", "own_probs", "alt_tokens", "alt_probs"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None) and (a is None or a.tobytes() == b.tobytes()), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_service_rounds_draft_what_a_full_rebuild_drafts(models, dtype):
    """Random rounds through the service: opens, continues of 1..4 tokens with their rows,
    re-opens of the same id with another history, releases, idle expiry, mixed depths and
    temperatures in one batch. Every round's drafts (tokens and probabilities, bit for bit)
    equal those of the reference drafting from reference histories; the service's
    histories hold the reference's rows (in the drafter's type); device windows never outnumber open requests."""
    d, ref = drafters(models, dtype)
    service = DraftService(d, ServiceConfig(max_requests=12))
    fp, n, f = service.fingerprint, d.window, d.feature
    rng = np.random.default_rng(1 if dtype == "float32" else 2)
    open_: dict[int, tuple[RefHistory, float, int]] = {}
    expired: set[int] = set()
    drafted = 0
    for step in range(200):
        entries, planned = [], []
        for rid in rng.choice(12, size=int(rng.integers(1, 9)), replace=False).tolist():
            k, want = int(rng.integers(0, d.max_depth + 1)), bool(rng.random() < 0.5)
            if rid in open_ and rng.random() < 0.05:
                entries.append(P.Entry(rid, P.OP_RELEASE))
                planned.append(("release", rid))
            elif rid in open_ and rid not in expired and rng.random() > 0.08:
                j = int(rng.integers(1, 5))
                h = open_[rid][0]
                tokens = rng.integers(0, d.vocab_size, j).astype(np.int32)
                rows = rng.standard_normal((j, f)).astype(np.float32)
                entries.append(P.Entry(rid, P.OP_CONTINUE, tokens, rows, k, want_probs=want,
                                       feature=f, length=h.length + j))
                planned.append(("continue", rid, tokens, rows))
            elif rid in expired:  # the worker dropped it: the client's continue is unknown
                entries.append(P.Entry(rid, P.OP_CONTINUE, np.array([1], np.int32),
                                       np.zeros((1, f), np.float32), k, feature=f,
                                       length=open_[rid][0].length + 1))
                planned.append(("unknown", rid))
            else:  # an open, or a re-open of an id already open with another history
                t = int(rng.integers(1, 3 * n))
                tokens = rng.integers(0, d.vocab_size, t).astype(np.int32)
                r = int(rng.integers(min(t - 1, n), t))  # at least the window's rows
                rows = rng.standard_normal((r, f)).astype(np.float32)
                temp, seed = float(rng.choice([0.0, 0.9])), int(rng.integers(0, 2**31))
                entries.append(P.Entry(rid, P.OP_OPEN, tokens, rows if r else None, k, temp, seed,
                                       want, f, t + int(rng.integers(0, 50))))
                planned.append(("open", rid, tokens, rows, temp, seed))
        if rng.random() < 0.05 and open_:  # idle expiry of one open request
            rid = int(rng.choice(sorted(set(open_) - expired))) if set(open_) - expired else None
            if rid is not None and all(p[1] != rid for p in planned):
                service.sessions[(LOCAL_PEER, CLIENT, rid)].last_used -= 1e9
                service.expire_idle()
                expired.add(rid)
        replies = P.parse_reply(service.handle(P.encode_request(entries, fp, client_id=CLIENT)))
        batch, asked = [], []
        for e, plan, reply in zip(entries, planned, replies):
            kind, rid = plan[0], plan[1]
            if kind in ("release", "unknown"):
                assert reply.status == (P.STATUS_RELEASED if kind == "release" else P.STATUS_UNKNOWN)
                open_.pop(rid)
                expired.discard(rid)
                continue
            assert reply.ok, reply.message
            if kind == "open":
                h = RefHistory(d.history_tokens, n, f)
                h.reset(plan[2], plan[3], e.length)
                open_[rid] = (h, plan[4], plan[5])
                expired.discard(rid)
            else:
                open_[rid][0].extend(plan[2], plan[3])
            if e.k:
                h, temp, seed = open_[rid]
                batch.append(DraftRequest(copy.copy(h), e.k, temp, seed))
                asked.append((e, reply))
        if batch:
            want_probs = any(e.want_probs for e, _ in asked)
            for (e, reply), draft in zip(asked, ref.draft(batch, want_probs)):
                assert reply.tokens.tobytes() == draft.tokens[:e.k].tobytes(), (step, e.request_id)
                if e.want_probs:
                    assert reply.probs.tobytes() == draft.probs[:e.k].tobytes(), (step, e.request_id)
            drafted += len(batch)
        for rid, (h, _, _) in open_.items():
            if rid not in expired:
                held = service.sessions[(LOCAL_PEER, CLIENT, rid)].history
                # kept in the drafter's type: the rows sent, cast as its device would cast them
                assert held.rows.tobytes() == cast(h.rows, held.dtype).tobytes() and held.length == h.length
                assert np.array_equal(held.tokens, h.tokens)
        assert windows(d) <= len(service.sessions)
    assert drafted > 400
    held = None  # the test's own reference to a session's history
    service.handle(P.encode_request([P.Entry(rid, P.OP_RELEASE) for rid in open_], fp,
                                    client_id=CLIENT))
    assert not service.sessions and windows(d) == 0  # released with their requests


def test_histories_and_their_copies_draft_what_a_full_rebuild_drafts(models):
    """History on its own, with what callers do to it: shallow copies (the service's
    snapshots) and deep copies that then go their own ways, resets, assigned rows (the
    client trimming to a worker's window), a window changed under it, extends with and
    without rows; windows of 3 to 40 rows against a drafter's 16. Rows and drafts equal the
    reference's after every operation."""
    d, ref = drafters(models, "float32")
    n, f = d.window, d.feature
    rng = np.random.default_rng(5)
    pool: list[tuple[History, RefHistory]] = []

    def fresh(window):
        t = int(rng.integers(1, 60))
        tokens = rng.integers(0, d.vocab_size, t).astype(np.int32)
        rows = rng.standard_normal((int(rng.integers(0, t)), f)).astype(np.float32)
        pair = History(64, window, f), RefHistory(64, window, f)
        for h in pair:
            h.reset(tokens, rows)
        return pair

    for step in range(900):
        op = rng.random()
        if not pool or op < 0.08:
            pool.append(fresh(int(rng.choice([3, 8, 16, 40]))))
        elif op < 0.18:
            h, r = pool[int(rng.integers(len(pool)))]
            how = copy.copy if rng.random() < 0.7 else copy.deepcopy
            pool.append((how(h), copy.copy(r)))
        elif op < 0.22:
            pool.pop(int(rng.integers(len(pool))))
        elif op < 0.26:
            i = int(rng.integers(len(pool)))
            pool[i] = fresh(pool[i][0].window)
        elif op < 0.30:  # the client adopting a worker's window: trim by assignment
            h, r = pool[int(rng.integers(len(pool)))]
            w = int(rng.choice([3, 8, 16]))
            h.window = r.window = w
            if rng.random() < 0.5:
                h.rows, r.rows = h.rows[-w:], r.rows[-w:]
        else:
            h, r = pool[int(rng.integers(len(pool)))]
            j = int(rng.integers(1, 2 * n if rng.random() < 0.1 else 5))
            tokens = rng.integers(0, d.vocab_size, j).astype(np.int32)
            rows = rng.standard_normal((j, f)).astype(np.float32) if rng.random() < 0.9 else None
            h.extend(tokens, rows)
            r.extend(tokens, rows)
        for h, r in pool:
            assert h.rows.tobytes() == r.rows.tobytes() and np.array_equal(h.tokens, r.tokens)
        drawn = [pool[i] for i in rng.permutation(len(pool))[:int(rng.integers(1, 5))]]
        drawn = [(h, r) for h, r in drawn if len(r.rows) <= n]  # the reference fits its window
        if drawn and step % 3 == 0:
            depth = int(rng.integers(1, d.max_depth + 1))
            got = d.draft([DraftRequest(h, depth) for h, _ in drawn], True)
            want = ref.draft([DraftRequest(r, depth) for _, r in drawn], True)
            for a, b in zip(got, want):
                assert_same(a, b)
    assert windows(d) <= len({id(h.lineage) for h, _ in pool})
    pool.clear()
    drawn = h = r = None  # the last pairs drawn
    assert windows(d) == 0


def test_device_rows_go_with_their_requests(models):
    """A window per drafted request, dropped on release, idle expiry and re-open (the old
    history's rows with it), and never served stale: a re-open with other rows drafts from
    those rows."""
    d, ref = drafters(models, "float32")
    service = DraftService(d, ServiceConfig(max_requests=4))
    fp, f = service.fingerprint, d.feature
    rng = np.random.default_rng(3)

    def open_entry(rid):
        tokens = rng.integers(0, d.vocab_size, 30).astype(np.int32)
        return P.Entry(rid, P.OP_OPEN, tokens, rng.standard_normal((29, f)).astype(np.float32), 3,
                       want_probs=True, feature=f, length=30)

    def round_(entries):
        return P.parse_reply(service.handle(P.encode_request(entries, fp, client_id=CLIENT)))

    round_([open_entry(rid) for rid in (1, 2, 3)])
    assert windows(d) == 3
    round_([P.Entry(1, P.OP_RELEASE)])
    assert windows(d) == 2
    service.sessions[(LOCAL_PEER, CLIENT, 2)].last_used -= 1e9
    service.expire_idle()
    assert windows(d) == 1
    again = open_entry(3)
    got = round_([again])[0]
    assert windows(d) == 1  # the re-opened request's old rows went with its old history
    h = RefHistory(d.history_tokens, d.window, f)
    h.reset(again.tokens, again.rows, again.length)
    want = ref.draft([DraftRequest(h, 3)], True)[0]
    assert got.tokens.tobytes() == want.tokens.tobytes() and got.probs.tobytes() == want.probs.tobytes()
    round_([P.Entry(3, P.OP_RELEASE)])
    assert windows(d) == 0 and not service.sessions


def test_ring_pool_grows_keeps_rows_and_reuses_zeroed_slots():
    """The pool's slots: a fifth request grows it (4 -> 8) and every ring keeps its rows; a
    request's slot comes back when its history goes and is zeroed before the next one takes
    it; two snapshots of one history at different points in one batch each get their own."""
    import gc

    from remote_drafter.models.window import DeviceWindows
    windows, rng = DeviceWindows(4, 3), np.random.default_rng(0)

    def history(n):
        h = History(64, 4, 3)
        h.reset(np.arange(n + 1, dtype=np.int32), rng.standard_normal((n, 3)).astype(np.float32))
        return h
    kept = [history(2 + i % 3) for i in range(5)]
    ctx, m = windows.lay_out(kept, "cpu")
    pool = windows["cpu"]
    assert len(pool.store) == 8 and len(pool) == 5 and m.tolist() == [2, 3, 4, 2, 3]
    for i, h in enumerate(kept):
        assert torch.equal(ctx[i, 4 - m[i]:], torch.tensor(h.rows[-m[i]:]))
    again, _ = windows.lay_out(kept, "cpu")
    assert torch.equal(again, ctx)  # nothing new: the same rows, from the slots
    slot = pool.rings[kept[0].lineage].slot
    del kept[0]
    gc.collect()
    assert slot in pool.free and len(pool) == 4
    short = history(1)
    ctx, m = windows.lay_out([short], "cpu")
    assert pool.rings[short.lineage].slot == slot and m.tolist() == [1]
    assert not ctx[0, :3].any()  # the slot's old rows are gone
    later = copy.copy(short)
    later.extend(np.array([7], np.int32), np.ones((1, 3), np.float32))
    ctx, m = windows.lay_out([short, later], "cpu")
    assert m.tolist() == [1, 2] and torch.equal(ctx[0, 3], ctx[1, 2]) and ctx[1, 3].eq(1).all()
    # the newer snapshot first, then the older one (a fresh ring replaces the newer's), then a
    # new request (which takes a free slot): every context as its history holds it, the
    # whole round worked out on the host before any part's rows are read
    older = history(2)
    windows.lay_out([older], "cpu")
    newer = copy.copy(older)
    newer.extend(np.array([7], np.int32), np.ones((1, 3), np.float32))
    fresh = history(3)
    ctx, m = windows.lay_out([newer, older, fresh], "cpu")
    assert m.tolist() == [3, 2, 3]
    for i, h in enumerate([newer, older, fresh]):
        assert torch.equal(ctx[i, 4 - m[i]:], torch.tensor(h.rows[-m[i]:])), i
