"""The engine side holds and sends at most the drafter's window of hidden rows per request,
whatever the prompt: only each request's newest window of committed rows leaves the device,
the proposer keeps one window per request until its first round, and the open carries that
window (what the worker keeps of a longer history anyway), in the drafter's compute dtype. Unit tier: torch on the CPU, a
real worker over tcp on loopback."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.engine.history import History  # noqa: E402
from remote_drafter.models.ngram import NgramDrafter  # noqa: E402
from remote_drafter.vllm import hooks  # noqa: E402
from remote_drafter.vllm.hooks import committed_rows  # noqa: E402
from remote_drafter.vllm.proposer import RemoteProposer  # noqa: E402
from remote_drafter.worker.server import Worker  # noqa: E402

WIDTH, WINDOW = 8, 16


class RowReadingNgram(NgramDrafter):
    """An n-gram drafter that takes hidden rows (of one tap), as a DSpark drafter does."""
    feature, window, hidden_layers = WIDTH, WINDOW, (3,)

    def __init__(self):
        super().__init__(vocab_size=1000, max_depth=4)
        self.window = WINDOW


def scheduler_output(scheduled: dict, spec: dict | None = None, finished=()):
    return SimpleNamespace(num_scheduled_tokens=scheduled,
                           scheduled_spec_decode_tokens=spec or {}, finished_req_ids=set(finished))


def test_only_the_newest_window_of_each_request_leaves_the_device(monkeypatch):
    """A 1,000-token prefill chunk beside a decode row that accepted one of two drafts: the
    chunk's last 16 rows and the decode row's 2 committed rows are copied, nothing else."""
    copied = []
    real = hooks.as_rows
    monkeypatch.setattr(hooks, "as_rows", lambda t: copied.append(tuple(t.shape)) or real(t))
    aux = [torch.arange(1003 * 4, dtype=torch.float32).reshape(1003, 4), -torch.ones(1003, 4)]
    out = committed_rows(scheduler_output({"long": 1000, "decode": 3}, {"decode": [7, 8]}),
                         ["long", "decode"], [[], [5, 6]], aux, (2, 9), keep=WINDOW)
    assert copied == [(WINDOW + 2, 8)]
    stacked = torch.cat(aux, -1).numpy()
    np.testing.assert_array_equal(out["long"], stacked[1000 - WINDOW:1000])
    np.testing.assert_array_equal(out["decode"], stacked[1000:1002])


@pytest.fixture
def proposer(monkeypatch):
    worker = Worker(RowReadingNgram()).start()
    monkeypatch.setenv("REMOTE_DRAFTER_ADDRESS", worker.address)
    # what is sent and held is asserted here, not speed: a busy machine must not fail a round
    monkeypatch.setenv("REMOTE_DRAFTER_DEADLINE_MS", "30000")
    for name in ("VLLM_DSPARK_REMOTE_ASYNC", "REMOTE_DRAFTER_METRICS_LISTEN",
                 "REMOTE_DRAFTER_HIDDEN_LAYERS", "REMOTE_DRAFTER_TARGET"):
        monkeypatch.delenv(name, raising=False)
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0)
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                             model_config=SimpleNamespace(max_model_len=4096),
                             parallel_config=parallel)
    p = RemoteProposer(config)
    p.load_model()
    yield p, worker
    p.client.close()
    worker.stop()


def test_a_long_prompt_costs_one_window_held_and_sent(proposer):
    p, worker = proposer
    assert p.hidden_layers == (3,) and p.window == WINDOW
    prompt = np.arange(1, 2001, dtype=np.int32) % 97 + 1
    rows = np.random.default_rng(0).standard_normal((2000, WIDTH)).astype(np.float32)
    for chunk in range(4):  # four prefill chunks of 500 before the first sampled token
        p.set_batch(["r"], (), {"r": rows[500 * chunk:500 * (chunk + 1)]})
        assert p.rows_held() <= WINDOW
    sent_before = worker.service.metrics.value("request_bytes")
    tokens = np.append(prompt, 5).astype(np.int32)
    p.propose([[5]], [len(tokens)], tokens[None, :])
    sent = worker.service.metrics.value("request_bytes") - sent_before
    assert sent < tokens.nbytes + (WINDOW + 1) * WIDTH * 4 + 1024  # a window of rows, not 2,000
    [session] = worker.service.sessions.values()
    np.testing.assert_array_equal(session.history.rows, rows[-WINDOW:])  # the same rows as all
    assert p.metrics.value("hidden_rows_copied") == 2000
    assert p.rows_held() == WINDOW  # the client's window, kept to re-open from
    c = p.client.counters()
    assert c["rows_sent"] == WINDOW and c["row_bytes_sent"] == WINDOW * WIDTH * 4  # float32


class Bf16RowReadingNgram(RowReadingNgram):
    """As above, described as computing in bf16 (a DSpark drafter on its card)."""

    dtype = "bfloat16"


def test_rows_travel_in_the_drafters_compute_dtype(monkeypatch):
    """A drafter computing in bf16 gets its rows as bf16 (half the bytes); they arrive as the
    bf16 rounding of the target's rows (what the drafter casts them to anyway)."""
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.rows import BFLOAT16, cast
    from remote_drafter.engine.transport import RemoteTransport
    worker = Worker(Bf16RowReadingNgram()).start()
    client = DrafterClient(RemoteTransport(worker.address), "64:3")
    try:
        assert client.worker_info(5.0).row_dtype == "bfloat16"
        rows = np.random.default_rng(2).standard_normal((40, WIDTH)).astype(np.float32)
        client.add_request(1, np.arange(1, 42, dtype=np.int32), rows)
        client.propose(3)
        [session] = worker.service.sessions.values()
        kept = session.history.rows  # kept as bf16, the bf16 rounding of the target's rows
        assert kept.dtype == BFLOAT16 and kept.tobytes() == cast(rows[-WINDOW:], BFLOAT16).tobytes()
        c = client.counters()
        assert c["rows_sent"] == WINDOW and c["row_bytes_sent"] == WINDOW * WIDTH * 2
    finally:
        client.close()
        worker.stop()


def test_more_tokens_than_a_window_between_rounds_reopens_from_the_window(proposer):
    """A request that gains more tokens than a window between two of its rounds is opened
    again from its window (a commit would need a row per token)."""
    p, worker = proposer
    first = np.arange(1, 41, dtype=np.int32)
    rows = np.random.default_rng(1).standard_normal((100, WIDTH)).astype(np.float32)
    p.set_batch(["r"], (), {"r": rows[:39]})
    p.propose([[40]], [40], first[None, :])
    opens = worker.service.metrics.value("opens")
    p.set_batch(["r"], (), {"r": rows[39:99]})  # 60 more committed rows: over the window
    more = np.arange(1, 101, dtype=np.int32)
    p.propose([[100]], [100], more[None, :])
    assert worker.service.metrics.value("opens") == opens + 1
    [session] = worker.service.sessions.values()
    assert session.history.length == 100
    np.testing.assert_array_equal(session.history.rows, rows[99 - WINDOW:99])
    assert History(4096, WINDOW, WIDTH).check(more, rows[99 - WINDOW:99], opening=True) is None


def test_the_worker_keeps_a_window_of_a_longer_history_and_refuses_bad_rows_alone():
    """An open carrying more rows than the window keeps the newest window (and the worker's
    token bound); an entry with an infinite row gets one line and status 3, while the same
    client's other request in that round keeps its state and is served."""
    from remote_drafter.engine import protocol as P
    from remote_drafter.worker.service import DraftService
    d = RowReadingNgram()
    svc, fp = DraftService(d), d.manifest().fingerprint

    def send(*entries):
        return P.parse_reply(svc.handle(P.encode_request(list(entries), fp, client_id=9)))

    tokens = np.arange(1, 6001, dtype=np.int32) % 97 + 1
    rows = np.random.default_rng(3).standard_normal((5999, WIDTH)).astype(np.float32)
    [opened] = send(P.Entry(1, P.OP_OPEN, tokens, rows, 2, length=6000))
    assert opened.ok and len(opened.tokens) > 0
    [session] = svc.sessions.values()
    np.testing.assert_array_equal(session.history.rows, rows[-WINDOW:])
    assert len(session.history.tokens) <= d.history_tokens and session.history.length == 6000
    infinite = rows[:3].copy()
    infinite[1, 5] = np.inf
    bad, good = send(P.Entry(2, P.OP_OPEN, tokens[:4], infinite, 2, length=4),
                     P.Entry(1, P.OP_CONTINUE, tokens[:1], rows[:1], 2, length=6001))
    assert bad.status == P.STATUS_INVALID and "infinity" in bad.message and "\n" not in bad.message
    [after] = svc.sessions.values()
    assert good.ok and after.history.length == 6001


def test_a_continue_sends_the_historys_newest_rows_and_reopens_once_they_outgrow_it():
    """Rows committed since the last round go as the client history's newest rows (no second
    copy kept beside it); steps left without a round past the worker's window re-open the
    request with that window, and the drafts equal a fresh client's."""
    from remote_drafter.engine.client import DrafterClient
    from remote_drafter.engine.transport import LocalTransport
    from remote_drafter.worker.service import DraftService

    service = DraftService(RowReadingNgram())
    client = DrafterClient(LocalTransport(service), "8:3")
    rng = np.random.default_rng(0)
    prompt = (np.arange(40) % 7).astype(np.int32)
    client.add_request(1, prompt, rng.standard_normal((39, WIDTH)).astype(np.float32))
    client.propose()
    sent = []
    real = client._encode
    client._encode = lambda entries, info: sent.append([(e.op, len(e.tokens), None if e.rows is None else len(e.rows))
                                                        for e in entries]) or real(entries, info)
    client.commit(1, [5, 6], rng.standard_normal((2, WIDTH)).astype(np.float32))
    client.propose()
    assert sent[-1] == [(0, 2, 2)]  # a continue: the two new tokens and rows
    for i in range(WINDOW + 1):  # more than a window without a round
        client.commit(1, [i % 7], rng.standard_normal((1, WIDTH)).astype(np.float32))
    assert client.requests[1].needs_open and client.rows_held() == WINDOW
    drafts = client.propose()
    assert sent[-1] == [(1, len(client.requests[1].history.tokens), WINDOW)]  # an open with the window
    fresh = DrafterClient(LocalTransport(DraftService(RowReadingNgram())), "8:3")
    h = client.requests[1].history
    fresh.add_request(1, h.tokens, h.rows)
    assert {r: d.tokens.tolist() for r, d in drafts.items()} == \
        {r: d.tokens.tolist() for r, d in fresh.propose().items()}
