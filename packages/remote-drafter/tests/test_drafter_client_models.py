"""The engine-side client with the model drafters (torch side): rows from tensors of any
dtype, probabilities that would overflow the reply, the worker's window adopted, round
sizes with hidden rows."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the dev venv / tools/test's unit tier runs it")

from remote_drafter.decode_loop import plain_decode, speculative_decode  # noqa: E402
from remote_drafter.engine import protocol as P  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.rows import BFLOAT16, as_rows  # noqa: E402
from remote_drafter.engine.transport import LocalTransport  # noqa: E402
from remote_drafter.models.registry import load_drafter  # noqa: E402
from remote_drafter.worker.service import DraftService  # noqa: E402


def test_rows_from_tensors_of_any_dtype():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    assert as_rows(t).dtype == BFLOAT16 and as_rows(t).astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert as_rows(t.to(torch.int64)).dtype == np.float32 and as_rows(t.double()).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_probabilities_that_would_overflow_the_reply_are_skipped_not_failed(models, target):
    transport = LocalTransport(DraftService(load_drafter("lm", models["target"])))
    transport.max_round_bytes = 6000  # room for two replies with 5 x 96 probabilities
    client = DrafterClient(transport, "8:5", want_probs=True)
    prompts = {1: [1, 2, 3], 2: [4, 5, 6], 3: [7, 8, 9]}
    result = speculative_decode(target, client, prompts, 12)
    assert result.tokens == {r: plain_decode(target, p, 12) for r, p in prompts.items()}
    c = client.counters()
    assert c["drafts_skipped_reply_size"] > 0 and c["rounds_failed"] == 0 and c["drafts"] > 0


def test_the_client_keeps_what_the_worker_looks_at(models, target):
    """A client configured with a smaller window than the worker's adopts the worker's,
    so opens carry the rows the worker needs."""
    client = DrafterClient(LocalTransport(DraftService(load_drafter(models["dspark"], models["target"]))),
                           "8:5", window=4)
    prompts = {1: list(range(1, 30))}
    result = speculative_decode(target, client, prompts, 10, hidden_layers=(0, 2, 3))
    assert result.tokens[1] == plain_decode(target, prompts[1], 10)
    assert client.window == 16 and client.counters()["entries_failed"] == 0


def test_continues_left_out_of_a_full_round_stay_continues(models):
    """Rounds with room for three opens and two continues: the opens spread over steps, and
    a continue left out waits as a continue (not a window-sized re-open, which would keep
    the round full of re-opens and never draft every request in one step)."""
    drafter = load_drafter(models["dspark"], models["target"])
    transport = LocalTransport(DraftService(drafter))
    f, n, rng = drafter.feature, 8, np.random.default_rng(0)
    tokens, rows = np.zeros(40, np.int32), np.zeros((drafter.window, f), np.float32)
    opened = P.entry_bytes(P.Entry(0, P.OP_OPEN, tokens, rows), "float32")
    continued = P.entry_bytes(P.Entry(0, P.OP_CONTINUE, tokens[:1], rows[:1]), "float32")
    transport.max_round_bytes = P.REQUEST_HEADER.itemsize + 3 * opened + 2 * continued
    client = DrafterClient(transport, "64:5")
    for rid in range(n):
        client.add_request(rid, rng.integers(0, drafter.vocab_size - 1, 40),
                           rng.standard_normal((39, f)).astype(np.float32))
    drafted = []
    for _ in range(12):
        drafted.append(len(client.propose()))
        for rid in range(n):
            client.commit(rid, [int(rng.integers(0, drafter.vocab_size - 1))],
                          rng.standard_normal((1, f)).astype(np.float32))
    assert drafted[0] < n and drafted[-4:] == [n] * 4, drafted
    assert client.counters()["opens_too_large"] == 0
