"""No network set-up on the engine thread: a worker that drops the link every few rounds
costs the engine failed rounds (target-only steps), never a connect or handshake in its
step; the link comes back from a background thread, re-opened requests carry only what
the worker keeps, and every draft made is the one the drafter makes from that history (as
a local drafter makes it). The engine thread's time in the drafter is observed per step.
Unit tier: a real worker over tcp on loopback; the fault fires on a count of rounds served."""

import itertools
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from ofl import client as ofl_client
from ofl.testing import wait_until
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.transport import LocalTransport
from remote_drafter.models.ngram import NgramDrafter
from remote_drafter.vllm.proposer import RemoteProposer
from remote_drafter.worker.server import Worker
from remote_drafter.worker.service import DraftService

STEPS, DROP_EVERY, DEADLINE_S = 60, 5, 0.2


def drafter() -> NgramDrafter:
    return NgramDrafter(vocab_size=1000, max_depth=4)


def vllm_config() -> SimpleNamespace:
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0)
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3),
                           model_config=SimpleNamespace(max_model_len=4096), parallel_config=parallel)


@pytest.fixture
def dropping_worker(monkeypatch):
    """A worker that closes every link it holds after each DROP_EVERY-th round it answers."""
    worker = Worker(drafter())
    answered = itertools.count(1)

    def answer_then_drop(payload, peer):
        reply = worker.service.handle(payload, peer)
        if next(answered) % DROP_EVERY == 0:
            for channel in list(worker.server._conns.values()):  # the drill: drop every link
                channel.close()
        return reply

    worker.server.handler = answer_then_drop
    worker.start()
    monkeypatch.setenv("REMOTE_DRAFTER_ADDRESS", worker.address)
    monkeypatch.setenv("REMOTE_DRAFTER_DEADLINE_MS", str(int(DEADLINE_S * 1000)))
    for name in ("VLLM_DSPARK_REMOTE_ASYNC", "REMOTE_DRAFTER_METRICS_LISTEN",
                 "REMOTE_DRAFTER_HIDDEN_LAYERS", "REMOTE_DRAFTER_TARGET"):
        monkeypatch.delenv(name, raising=False)
    yield worker
    worker.stop()


def test_dropped_links_come_back_off_the_engine_thread_and_drafts_stay_exact(dropping_worker, monkeypatch):
    connects = []  # the thread of every connect after start-up
    real_connect = ofl_client.Connection._connect
    monkeypatch.setattr(ofl_client.Connection, "_connect", lambda self, deadline: (
        connects.append(threading.current_thread()), real_connect(self, deadline))[1])
    proposer = RemoteProposer(vllm_config())
    proposer.load_model()  # start-up: the engine may connect here
    connects.clear()
    local = DrafterClient(LocalTransport(DraftService(drafter())))
    tokens = list(np.random.default_rng(0).integers(1, 60, 64))
    made, steps_with_drafts = 0, 0
    for step in range(STEPS):
        proposer.set_batch(["r"], ())
        row = np.asarray(tokens, np.int32)
        drafts = proposer.propose([[tokens[-1]]], [len(row)], row[None, :])[0]
        if drafts:  # what the drafter makes from this history, wherever it runs
            local.add_request(step, row)
            assert drafts == [int(t) for t in local.propose(3)[step].tokens[:3]]
            local.release(step)
            steps_with_drafts += 1
            made += len(drafts)
        else:  # the engine goes on decoding meanwhile; here, the next step waits for the link
            wait_until(lambda: proposer.client.transport.conn.connected, what="the background reconnect")
        tokens += [tokens[len(tokens) % 50]] * 2  # the sequence repeats: the n-grams find drafts
    proposer.set_batch(["r"], ())  # observes the last step
    transport = proposer.client.transport
    assert threading.main_thread() not in connects  # never on the engine thread
    assert transport.reconnects >= STEPS // DROP_EVERY // 2 and len(connects) >= transport.reconnects
    assert proposer.client.metrics.value("rounds_failed") >= transport.reconnects
    assert steps_with_drafts >= STEPS // 3 and made > 0  # drafting resumes after each drop
    blocked = proposer.metrics._samples["engine_blocked"]
    assert len(blocked) == STEPS
    # a step waits at most one round's deadline; 50 ms of margin for a busy 2-core machine
    assert max(blocked) < DEADLINE_S + 0.05, max(blocked)
    print(f"engine blocked per step: p50 {1e3 * np.median(blocked):.2f} ms, max "
          f"{1e3 * max(blocked):.2f} ms; {transport.reconnects} background reconnects")
    proposer.client.close()
    local.close()
